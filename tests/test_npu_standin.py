"""The torch_npu stand-in: each documented rule is broken once and rejected; correct calls compute the reference.

Every case starts from a call the stand-in accepts and changes one thing. ``test_every_rule_is_exercised``
keeps the table of cases and the table of rules in step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from torch_npu_standin import (  # noqa: E402
    RULES,
    ContractViolation,
    NotModelled,
    make_torch_npu_standin,
)

from kvsim.realexec.backends.cpu import CpuBackend  # noqa: E402
from kvsim.realexec.backends.kv_quant import KVScales, dequantize, quantize  # noqa: E402
from kvsim.realexec.backends.paged_cases import PagedCase, load_case, random_case  # noqa: E402

H, HKV, D, BS = 4, 2, 64, 128
MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


@dataclass
class Call:
    """An op name and its arguments; ``run`` invokes it on a fresh stand-in."""

    op: str
    args: dict

    def run(self):
        standin = make_torch_npu_standin()
        target = standin.atb if self.op.startswith("atb.") else standin
        return getattr(target, self.op.removeprefix("atb."))(**self.args)


def _loaded(query_lens, seq_lens, dtype=torch.float16, block_size=BS) -> tuple[PagedCase, torch.Tensor, torch.Tensor]:
    case = random_case(
        query_lens,
        seq_lens,
        num_heads=H,
        num_kv_heads=HKV,
        head_size=D,
        block_size=block_size,
        dtype=dtype,
        slot_dtype=torch.int32,
    )
    key_cache, value_cache = load_case(CpuBackend(), case)  # the caches' ND layout does not depend on the writer
    return case, key_cache, value_cache


def fia(decode: bool = False, **changes) -> Call:
    """A valid FIA call: TND query, BnBsH cache view, int32 block table, causal sparse mode 3."""
    case, kc, vc = _loaded([1, 1] if decode else [3, 1], [3, 130])
    nb = kc.shape[0]
    args = dict(
        query=case.query,
        key=kc.view(nb, BS, -1),
        value=vc.view(nb, BS, -1),
        atten_mask=MASK,
        block_table=case.meta.block_tables,
        input_layout="TND",
        block_size=BS,
        actual_seq_lengths=[1, 2] if decode else [3, 4],
        actual_seq_lengths_kv=[3, 130],
        num_key_value_heads=HKV,
        num_heads=H,
        scale=case.scale,
        sparse_mode=3,
    )
    return Call("npu_fused_infer_attention_score", args | changes)


def fia_int8(_block: int = BS, **changes) -> Call:
    """A valid int8-cache decode: BSH query, int8 BnBsH caches, separate per-channel antiquant scales (1, H)."""
    case, kc, vc = _loaded([1, 1], [3, 130], block_size=_block)
    scales = KVScales.from_absmax(case.key.abs().amax(0), case.value.abs().amax(0))
    nb = kc.shape[0]
    args = dict(
        query=case.query.view(2, 1, H * D),
        key=quantize(kc, scales.key).view(nb, _block, -1),
        value=quantize(vc, scales.value).view(nb, _block, -1),
        block_table=case.meta.block_tables,
        input_layout="BSH",
        block_size=_block,
        actual_seq_lengths_kv=[3, 130],
        num_key_value_heads=HKV,
        num_heads=H,
        scale=case.scale,
        key_antiquant_scale=scales.key.reshape(1, -1).half(),
        value_antiquant_scale=scales.value.reshape(1, -1).half(),
        key_antiquant_mode=0,
        value_antiquant_mode=0,
    )
    return Call("npu_fused_infer_attention_score", args | changes)


def pa(**changes) -> Call:
    case, kc, vc = _loaded([1, 1, 1], [5, 130, 40])
    args = dict(
        query=case.query,
        key_cache=kc,
        value_cache=vc,
        num_kv_heads=HKV,
        num_heads=H,
        scale_value=case.scale,
        block_table=case.meta.block_tables,
        context_lens=torch.tensor([5, 130, 40], dtype=torch.int32),
        out=torch.empty_like(case.query),
    )
    return Call("_npu_paged_attention", args | changes)


def scatter(**changes) -> Call:
    key = torch.randn(3, HKV, D).half()
    args = dict(
        key=key,
        value=key + 1,
        key_cache=torch.zeros(2, BS, HKV, D, dtype=torch.float16),
        value_cache=torch.zeros(2, BS, HKV, D, dtype=torch.float16),
        slot_mapping=torch.tensor([4, 200, 17], dtype=torch.int32),
        cache_mode="Norm",
    )
    return Call("npu_scatter_pa_kv_cache", args | changes)


def reshape(**changes) -> Call:
    args = scatter().args
    args["slot_indices"] = args.pop("slot_mapping")
    del args["cache_mode"]
    return Call("_npu_reshape_and_cache", args | changes)


def gather(**changes) -> Call:
    case, kc, vc = _loaded([1, 1], [3, 130])
    args = dict(
        key_cache=kc,
        value_cache=vc,
        block_tables=case.meta.block_tables,
        seq_lens=case.meta.seq_lens,
        key=torch.empty(133, HKV, D, dtype=torch.float16),
        value=torch.empty(133, HKV, D, dtype=torch.float16),
    )
    return Call("npu_gather_pa_kv_cache", args | changes)


def load(**changes) -> Call:
    args = gather().args
    args = dict(
        key_cache=args["key_cache"],
        value_cache=args["value_cache"],
        block_table=args["block_tables"],
        context_lens=args["seq_lens"],
    )
    return Call("atb.npu_paged_cache_load", args | changes)


# -- MoE and MLA ops (vllm-ascend's all-gather MoE path, FIA v2's MLA mode) ---------------------------
E, TOP_K, HID = 8, 2, 64
IDS = torch.tensor([[0, 3], [3, 5], [7, 0], [1, 3], [3, 2]], dtype=torch.int32)
COUNTS = torch.tensor([2, 1, 0, 3, 0, 1, 0, 1], dtype=torch.int64)  # tokens per expert, 8 rows
_MOE_GEN = torch.Generator().manual_seed(5)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_MOE_GEN).bfloat16()


def gating(**changes) -> Call:
    return Call("npu_moe_gating_top_k_softmax", dict(x=_bf16(5, E), k=TOP_K) | changes)


def routing(**changes) -> Call:
    args = dict(x=_bf16(5, HID), expert_idx=IDS, active_num=10, expert_num=E, expert_tokens_num_type=1,
                expert_tokens_num_flag=True, active_expert_range=[0, E], quant_mode=-1)
    return Call("npu_moe_init_routing_v2", args | changes)


def gmm(**changes) -> Call:
    args = dict(x=[_bf16(8, HID)], weight=[_bf16(E, HID, 32)], split_item=2, group_list_type=1, group_type=0,
                group_list=COUNTS)
    return Call("npu_grouped_matmul", args | changes)


def swiglu(**changes) -> Call:
    return Call("npu_swiglu", dict(x=_bf16(4, 64)) | changes)


def unpermute(**changes) -> Call:
    args = dict(permuted_tokens=_bf16(10, HID), sorted_indices=torch.randperm(10, generator=_MOE_GEN).int(),
                probs=_bf16(5, 2))
    return Call("npu_moe_token_unpermute", args | changes)


def fia2(heads: int = 4, latent: int = 512, **changes) -> Call:
    """A valid absorbed MLA decode: BNSD_NBSD query of latent 512 + rope 64, paged (blocks, 1, 128, D) caches."""
    key = _bf16(3, 1, BS, latent)
    args = dict(query=_bf16(2, heads, 1, latent), key=key, value=key, query_rope=_bf16(2, heads, 1, 64),
                key_rope=_bf16(3, 1, BS, 64), num_query_heads=heads, num_key_value_heads=1, input_layout="BNSD_NBSD",
                atten_mask=None, sparse_mode=0, softmax_scale=0.07, block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
                block_size=BS, actual_seq_kvlen=[130, 5])
    return Call("npu_fused_infer_attention_score_v2", args | changes)


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _with(make: Callable[..., Call], edit: Callable[[dict], dict]) -> Callable[[], Call]:
    """A case whose arguments depend on the valid ones."""
    return lambda: Call(make().op, edit(make().args))


def _key_value(edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], dict]:
    return lambda a: a | {"key": edit(a["key"]), "value": edit(a["value"])}


def _caches(shape, dtype=torch.float16) -> dict:
    return {"key_cache": torch.zeros(shape, dtype=dtype), "value_cache": torch.zeros(shape, dtype=dtype)}


BAD_TABLE = torch.tensor([[0, 99], [1, 2], [3, 0]], dtype=torch.int32)

VIOLATIONS: list[tuple[str, Callable[[], Call]]] = [
    # npu_scatter_pa_kv_cache
    ("scatter.contiguous", _with(scatter, lambda a: a | {"key": _noncontiguous(a["key"])})),
    ("scatter.same_dtype", _with(scatter, lambda a: a | {"key": a["key"].bfloat16()})),
    ("scatter.slot_dtype", _with(scatter, lambda a: a | {"slot_mapping": a["slot_mapping"].short()})),
    (
        "scatter.cache_mode",
        _with(scatter, lambda a: {k: v for k, v in a.items() if k != "cache_mode"}),
    ),  # default 'PA_NZ'
    ("scatter.cache_mode", lambda: scatter(cache_mode="ND")),
    (
        "scatter.cache_rank",
        _with(
            scatter,
            lambda a: (
                a | {"key_cache": a["key_cache"].view(2, BS, -1), "value_cache": a["value_cache"].view(2, BS, -1)}
            ),
        ),
    ),
    ("scatter.kv_leading_dims", _with(scatter, lambda a: a | {"value": a["value"][:2]})),
    ("scatter.norm_shapes", _with(scatter, lambda a: a | {"slot_mapping": a["slot_mapping"][:2]})),
    ("scatter.norm_shapes", lambda: scatter(key=torch.zeros(3, 1, D).half(), value=torch.zeros(3, 1, D).half())),
    ("scatter.slot_range", lambda: scatter(slot_mapping=torch.tensor([4, 256, 17], dtype=torch.int32))),
    ("scatter.slot_range", lambda: scatter(slot_mapping=torch.tensor([4, -2, 17], dtype=torch.int32))),
    ("scatter.slot_unique", lambda: scatter(slot_mapping=torch.tensor([4, 17, 4], dtype=torch.int32))),
    # _npu_reshape_and_cache
    ("reshape.shapes", _with(reshape, lambda a: a | {"key": a["key"].flatten(1), "value": a["value"].flatten(1)})),
    ("reshape.slot_dtype", _with(reshape, lambda a: a | {"slot_indices": a["slot_indices"].long()})),
    ("reshape.slots_valid", lambda: reshape(slot_indices=torch.tensor([4, 4, 17], dtype=torch.int32))),
    ("reshape.slots_valid", lambda: reshape(slot_indices=torch.tensor([4, 999, 17], dtype=torch.int32))),
    # npu_fused_infer_attention_score
    ("fia.layout", lambda: fia(input_layout="THD")),
    ("fia.contiguous", _with(fia, lambda a: a | {"query": _noncontiguous(a["query"])})),
    ("fia.query_dtype", _with(fia, lambda a: a | {"query": a["query"].float()})),
    ("fia.kv_dtype", _with(fia, _key_value(lambda t: t.float()))),
    ("fia.kv_same_shape", _with(fia, lambda a: a | {"value": a["value"][:-1]})),
    ("fia.seq_lengths_are_lists", lambda: fia(actual_seq_lengths=torch.tensor([3, 4]))),
    ("fia.seq_lengths_are_lists", lambda: fia(actual_seq_lengths_kv=torch.tensor([3, 130], dtype=torch.int32))),
    ("fia.tnd_actual_seq_lengths", lambda: fia(actual_seq_lengths=None)),
    ("fia.tnd_actual_seq_lengths", lambda: fia(actual_seq_lengths=[3, 1])),  # per-sequence, not cumulative
    ("fia.actual_seq_lengths_bound", lambda: fia(actual_seq_lengths=[3, 9])),
    ("fia.tnd_total_tokens", lambda: fia(actual_seq_lengths=[2, 3])),  # a query row no batch owns
    ("fia.pa_actual_seq_lengths_kv", lambda: fia(actual_seq_lengths_kv=None)),
    ("fia.pa_kv_lengths_per_batch", lambda: fia(actual_seq_lengths_kv=[133])),
    ("fia.pa_kv_lengths_per_batch", lambda: fia(actual_seq_lengths_kv=[-1, 130])),
    ("fia.block_table_dtype", _with(fia, lambda a: a | {"block_table": a["block_table"].long()})),
    ("fia.pa_block_table_shape", _with(fia, lambda a: a | {"block_table": a["block_table"][:1]})),
    ("fia.pa_block_table_shape", _with(fia, lambda a: a | {"block_table": a["block_table"][:, :1].contiguous()})),
    ("fia.pfa_block_size", lambda: fia(block_size=64)),
    ("fia.pfa_block_size", lambda: fia(block_size=16)),
    ("fia.ifa_block_size", lambda: fia(decode=True, block_size=24)),
    ("fia.ifa_block_size", lambda: fia(decode=True, block_size=1024)),
    ("fia.pa_kv_layout", _with(fia, _key_value(lambda t: t.view(t.shape[0], BS, HKV, D, 1)))),
    ("fia.pa_kv_dims", _with(fia, _key_value(lambda t: t.view(t.shape[0], BS, HKV, D)))),  # ND passed as BnNBsD
    ("fia.pa_kv_dims", lambda: fia(num_key_value_heads=1)),
    (
        "fia.bnbsh_hidden_limit",
        lambda: fia(
            query=torch.zeros(4, 129, 512, dtype=torch.float16),
            num_heads=129,
            num_key_value_heads=129,
            key=torch.zeros(1, BS, 129 * 512, dtype=torch.float16),
            value=torch.zeros(1, BS, 129 * 512, dtype=torch.float16),
        ),
    ),
    ("fia.pa_num_blocks", _with(fia, _key_value(lambda t: t[:2]))),
    ("fia.block_ids", _with(fia, lambda a: a | {"block_table": torch.tensor([[0, 0], [5, 60]], dtype=torch.int32)})),
    ("fia.gqa_heads", lambda: fia(num_key_value_heads=3)),
    ("fia.gqa_heads", lambda: fia(query=torch.zeros(4, 130, D, dtype=torch.float16), num_heads=130)),
    ("fia.num_heads", lambda: fia(num_heads=8)),
    (
        "fia.n_d_limits",
        lambda: fia(query=torch.zeros(4, 258, D, dtype=torch.float16), num_heads=258, num_key_value_heads=258),
    ),
    ("fia.n_d_limits", lambda: fia(query=torch.zeros(4, H, 528, dtype=torch.float16))),
    ("fia.pfa_d_alignment", lambda: fia(query=torch.zeros(4, H, 72, dtype=torch.float16))),
    ("fia.sparse_mode_values", lambda: fia(sparse_mode=5)),
    ("fia.sparse_mode_values", lambda: fia(sparse_mode=9)),
    ("fia.tnd_sparse_modes", lambda: fia(sparse_mode=1)),
    ("fia.tnd_sparse_modes", lambda: fia(sparse_mode=0)),  # a mask without a sparse mode to read it
    ("fia.compressed_mask_shape", lambda: fia(atten_mask=None)),
    ("fia.compressed_mask_shape", lambda: fia(atten_mask=MASK[:1024, :1024].contiguous())),
    ("fia.mask_dtype", lambda: fia(atten_mask=MASK.half())),
    ("fia.causal_mask_content", lambda: fia(atten_mask=~MASK)),  # True = attend is the wrong way round
    ("fia.causal_query_fits_context", lambda: fia(actual_seq_lengths_kv=[2, 130])),
    # npu_fused_infer_attention_score over an int8 cache
    ("fia.antiquant_pair", lambda: fia_int8(value_antiquant_scale=None)),
    ("fia.int8_kv_scales", lambda: fia_int8(key_antiquant_scale=None, value_antiquant_scale=None)),
    ("fia.antiquant_modes", lambda: fia_int8(value_antiquant_mode=2)),
    ("fia.antiquant_per_channel", _with(fia_int8, lambda a: a | {"key_antiquant_scale": a["key_antiquant_scale"].float()})),
    ("fia.antiquant_per_channel", _with(fia_int8, lambda a: a | {"value_antiquant_scale": a["value_antiquant_scale"][:, :64]})),
    ("fia.antiquant_prompt", _with(fia_int8, lambda a: a | {"query": a["query"].expand(2, 2, -1).contiguous()})),
    ("fia.ifa_block_size", lambda: fia_int8(block_size=16, _block=16)),  # 16-aligned suffices for float K/V only
    ("fia.pa_num_blocks", _with(fia_int8, _key_value(lambda t: t[:2]))),
    # _npu_paged_attention
    ("pa.block_size_multiple", lambda: pa(**_caches((8, 24, HKV, D)))),
    ("pa.block_size_max", lambda: pa(**_caches((8, 256, HKV, D)))),
    ("pa.block_ids", lambda: pa(block_table=BAD_TABLE)),
    ("pa.head_size", lambda: pa(query=torch.zeros(3, H, 320, dtype=torch.float16), **_caches((8, BS, HKV, 320)))),
    ("pa.query_dtype", _with(pa, lambda a: a | {"query": a["query"].float()})),
    ("pa.out", _with(pa, lambda a: a | {"out": a["out"].float()})),
    ("pa.out", _with(pa, lambda a: a | {"out": a["out"][:2]})),
    ("pa.gqa", lambda: pa(num_kv_heads=3, **_caches((8, BS, 3, D)))),
    ("pa.heads_given", lambda: pa(num_heads=8)),
    ("pa.block_table", _with(pa, lambda a: a | {"block_table": a["block_table"].long()})),
    ("pa.block_table", _with(pa, lambda a: a | {"block_table": a["block_table"][:2]})),
    ("pa.context_lens", lambda: pa(context_lens=[5, 130, 40])),
    ("pa.context_lens", lambda: pa(context_lens=torch.tensor([5, 130, 40]))),
    (
        "pa.cache_layout",
        _with(pa, lambda a: a | {"key_cache": a["key_cache"].flatten(2), "value_cache": a["value_cache"].flatten(2)}),
    ),
    ("pa.cache_layout", lambda: pa(num_kv_heads=1)),
    ("pa.context_fits_table", lambda: pa(context_lens=torch.tensor([5, 500, 40], dtype=torch.int32))),
    ("pa.context_fits_table", lambda: pa(context_lens=torch.tensor([0, 130, 40], dtype=torch.int32))),
    # npu_gather_pa_kv_cache
    ("gather.block_tables", _with(gather, lambda a: a | {"block_tables": a["block_tables"].long()})),
    ("gather.seq_lens", _with(gather, lambda a: a | {"seq_lens": a["seq_lens"].long()})),
    ("gather.seq_lens", lambda: gather(is_seq_lens_cumsum=True)),  # [B] given where [B+1] is meant
    ("gather.outputs", lambda: gather(key=torch.empty(130, HKV, D, dtype=torch.float16))),
    ("gather.outputs", lambda: gather(value=torch.empty(133, HKV, D, dtype=torch.float32))),
    # atb.npu_paged_cache_load
    (
        "load.dtype",
        _with(load, lambda a: a | {"key_cache": a["key_cache"].float(), "value_cache": a["value_cache"].float()}),
    ),
    ("load.alignment", lambda: load(**_caches((4, BS, 1, 8)))),
    ("load.block_table", _with(load, lambda a: a | {"block_table": a["block_table"].long()})),
    ("load.context_lens", _with(load, lambda a: a | {"context_lens": a["context_lens"].long()})),
    ("load.context_lens", _with(load, lambda a: a | {"context_lens": a["context_lens"][:1]})),
    # MoE: gating, routing, grouped matmul, SwiGLU, unpermute
    ("gating.x", lambda: gating(x=_bf16(5, E).double())),
    ("gating.x", lambda: gating(x=_bf16(40))),
    ("gating.k", lambda: gating(k=E + 1)),
    ("routing.x", _with(routing, lambda a: a | {"x": a["x"].unsqueeze(0)})),
    ("routing.expert_idx", lambda: routing(expert_idx=IDS.long())),
    ("routing.expert_idx", lambda: routing(expert_idx=IDS + 1)),  # expert 8 of 8
    ("routing.expert_num", lambda: routing(expert_num=0)),
    ("routing.drop_pad_mode", lambda: routing(drop_pad_mode=1)),
    ("routing.tokens_num_type", lambda: routing(expert_tokens_num_type=0)),
    ("routing.tokens_num_flag", lambda: routing(expert_tokens_num_flag=False)),
    ("routing.quant_mode", lambda: routing(quant_mode=0)),
    ("routing.active_expert_range", lambda: routing(active_expert_range=[0, E + 1])),
    ("gmm.single_tensors", lambda: gmm(split_item=0)),
    ("gmm.single_tensors", _with(gmm, lambda a: a | {"weight": [a["weight"][0][0]]})),
    ("gmm.single_tensors", lambda: gmm(group_list=COUNTS + 1)),  # counts summing past x's rows
    ("gmm.group_list_dtype", lambda: gmm(group_list=COUNTS.int())),
    ("gmm.group_list_counts", lambda: gmm(group_list=torch.tensor([3, -1, 0, 3, 0, 1, 0, 2]))),
    ("gmm.dtypes", _with(gmm, lambda a: a | {"weight": [a["weight"][0].float()]})),
    ("gmm.inner_limit", lambda: gmm(x=[_bf16(8, 65536)], weight=[_bf16(E, 65536, 1)])),
    ("swiglu.dtype", lambda: swiglu(x=torch.ones(4, 64, dtype=torch.int32))),
    ("swiglu.halves", lambda: swiglu(x=_bf16(4, 63))),
    ("unpermute.tokens", _with(unpermute, lambda a: a | {"permuted_tokens": a["permuted_tokens"].half()})),
    ("unpermute.indices", lambda: unpermute(sorted_indices=torch.full((10,), 10, dtype=torch.int32))),  # past the rows
    ("unpermute.indices", _with(unpermute, lambda a: a | {"sorted_indices": a["sorted_indices"][:9]})),
    ("unpermute.probs", _with(unpermute, lambda a: a | {"probs": a["probs"].float()})),
    ("unpermute.probs", lambda: unpermute(probs=_bf16(5, 3))),
    ("unpermute.padded_mode", lambda: unpermute(padded_mode=True)),
    # npu_fused_infer_attention_score_v2 (MLA decode)
    ("fia2.rope_pair", lambda: fia2(key_rope=None)),
    ("fia2.mla_d", lambda: fia2(latent=256)),  # the toy small-mla's latent
    ("fia2.layout", lambda: fia2(input_layout="BNSD")),
    ("fia2.rope_tensors", _with(fia2, lambda a: a | {"query_rope": a["query_rope"].float()})),
    ("fia2.rope_tensors", _with(fia2, lambda a: a | {"key_rope": a["key_rope"].transpose(2, 3).contiguous().transpose(2, 3)})),
    ("fia2.query_rope_dtype", _with(fia2, lambda a: a | {"query_rope": a["query_rope"].half()})),
    ("fia2.key_rope_dtype", _with(fia2, lambda a: a | {"key_rope": a["key_rope"].half()})),
    ("fia2.mla_query", lambda: fia2(heads=3)),  # vllm-ascend pads heads to a power of two
    ("fia2.mla_query", _with(fia2, lambda a: a | {"query_rope": a["query_rope"][..., :32].contiguous()})),
    ("fia2.mla_key", lambda: fia2(num_key_value_heads=2)),
    ("fia2.mla_sparse", lambda: fia2(sparse_mode=3)),
    ("fia2.mla_page_attention", lambda: fia2(block_size=64)),
    ("fia2.mla_page_attention", lambda: fia2(block_table=None)),
    ("fia2.block_table", _with(fia2, lambda a: a | {"block_table": a["block_table"].long()})),
    ("fia2.kv_lengths", lambda: fia2(actual_seq_kvlen=torch.tensor([130, 5]))),
    ("fia2.kv_lengths", lambda: fia2(actual_seq_kvlen=[300, 5])),
]


def _case_id(case: tuple[str, Callable]) -> str:
    return case[0]


@pytest.mark.parametrize("rule_id,make", VIOLATIONS, ids=[_case_id(c) for c in VIOLATIONS])
def test_each_documented_misuse_is_rejected(rule_id: str, make: Callable[[], Call]) -> None:
    call = make()
    with pytest.raises(ContractViolation) as err:
        call.run()
    assert err.value.rule.id == rule_id, str(err.value)
    assert RULES[rule_id].quote in str(err.value) and RULES[rule_id].source in str(err.value)


def test_event_timing_needs_enable_timing() -> None:
    npu = make_torch_npu_standin().npu
    start, end = npu.Event(), npu.Event()
    start.record()
    end.record()
    with pytest.raises(ContractViolation) as err:
        start.elapsed_time(end)
    assert err.value.rule.id == "event.enable_timing"
    timed = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    timed[0].record()
    timed[1].record()
    assert timed[0].elapsed_time(timed[1]) >= 0


def test_every_rule_is_exercised() -> None:
    cases = VIOLATIONS + GRAPH_VIOLATIONS
    assert {rule_id for rule_id, _ in cases} | {"event.enable_timing"} == set(RULES)


def test_rules_cite_their_sources() -> None:
    for rule in RULES.values():
        assert rule.effect in ("rejects", "undefined", "convention")
        assert rule.quote and rule.source.endswith((".py", ".md", ".yaml", ".h", ".cpp"))


# -- correct calls are accepted and computed ----------------------------------------------------------


def test_fia_mixed_batch_computes_the_reference() -> None:
    out, lse = fia().run()
    case, _, _ = _loaded([3, 1], [3, 130])  # the same seeded case fia() was built from
    assert lse.shape == (1,)
    torch.testing.assert_close(out, case.expected(), atol=0, rtol=0)


def test_fia_decode_accepts_16_token_blocks() -> None:
    """IFA's rule (16-aligned, at most 512) is looser than PFA's (multiple of 128)."""
    case, kc, vc = _loaded([1, 1], [3, 40], block_size=16)
    nb = kc.shape[0]
    out, _ = Call(
        "npu_fused_infer_attention_score",
        fia(decode=True).args
        | dict(
            query=case.query,
            key=kc.view(nb, 16, -1),
            value=vc.view(nb, 16, -1),
            block_table=case.meta.block_tables,
            block_size=16,
            actual_seq_lengths_kv=[3, 40],
        ),
    ).run()
    torch.testing.assert_close(out, case.expected(), atol=0, rtol=0)


def test_fia_reads_the_bnnbsd_layout_too() -> None:
    call = fia()
    nb = call.args["key"].shape[0]
    head_major = {k: call.args[k].view(nb, BS, HKV, D).transpose(1, 2).contiguous() for k in ("key", "value")}
    out, _ = Call(call.op, call.args | head_major).run()
    torch.testing.assert_close(out, call.run()[0], atol=0, rtol=0)


def test_paged_attention_and_gathers_compute_the_reference() -> None:
    call = pa()
    call.run()
    case, _, _ = _loaded([1, 1, 1], [5, 130, 40])
    torch.testing.assert_close(call.args["out"], case.expected(), atol=0, rtol=0)

    g = gather()
    g.run()
    case, _, _ = _loaded([1, 1], [3, 130])
    assert torch.equal(g.args["key"], case.key) and torch.equal(g.args["value"], case.value)
    cumsum = gather(seq_lens=torch.tensor([0, 3, 133], dtype=torch.int32), is_seq_lens_cumsum=True)
    cumsum.run()
    assert torch.equal(cumsum.args["key"], case.key)

    key, value = load().run()
    assert torch.equal(key, case.key) and torch.equal(value, case.value)
    key, _ = load(context_lens=torch.tensor([0, 3, 133], dtype=torch.int32), cumsum=True).run()
    assert torch.equal(key, case.key)


def test_fia_int8_decode_dequantises_with_the_antiquant_scales() -> None:
    call = fia_int8()
    out, _ = call.run()
    case, kc, vc = _loaded([1, 1], [3, 130])
    key_scale = call.args["key_antiquant_scale"].float().view(HKV, D)
    value_scale = call.args["value_antiquant_scale"].float().view(HKV, D)
    nb = kc.shape[0]
    dequant_k = dequantize(call.args["key"].view(nb, BS, HKV, D), key_scale, torch.float32)
    dequant_v = dequantize(call.args["value"].view(nb, BS, HKV, D), value_scale, torch.float32)
    rows = [torch.arange(3), torch.arange(130)]
    tables = case.meta.block_tables.long()
    keys = torch.cat([dequant_k[tables[b]].flatten(0, 1)[r] for b, r in enumerate(rows)])
    values = torch.cat([dequant_v[tables[b]].flatten(0, 1)[r] for b, r in enumerate(rows)])
    expected = PagedCase(case.query.float(), keys, values, case.meta, case.num_blocks, case.scale).expected()
    torch.testing.assert_close(out.view(2, H, D).float(), expected, atol=2e-3, rtol=0)  # fp16 output rounding


def test_padding_slots_are_skipped_by_the_writes() -> None:
    """vLLM pads slot_mapping with -1; the cache-write kernels skip those tokens."""
    for call in (
        scatter(slot_mapping=torch.tensor([4, -1, 17], dtype=torch.int32)),
        reshape(slot_indices=torch.tensor([-1, -1, 17], dtype=torch.int32)),
    ):
        call.run()
        slots = call.args.get("slot_mapping", call.args.get("slot_indices")).long()
        real = slots >= 0
        assert torch.equal(call.args["key_cache"].view(-1, HKV, D)[slots[real]], call.args["key"][real])
        assert int(call.args["key_cache"].count_nonzero()) == int(call.args["key"][real].count_nonzero())


def test_writes_land_at_their_slots() -> None:
    for call in (scatter(), reshape(), scatter(slot_mapping=torch.tensor([4, 200, 17]))):
        call.run()
        slots = call.args.get("slot_mapping", call.args.get("slot_indices")).long()
        assert torch.equal(call.args["key_cache"].view(-1, HKV, D)[slots], call.args["key"])
        assert torch.equal(call.args["value_cache"].view(-1, HKV, D)[slots], call.args["value"])
        assert int(call.args["key_cache"].count_nonzero()) == int(call.args["key"].count_nonzero())


@pytest.mark.parametrize(
    "make",
    [
        lambda: fia(input_layout="BSH"),
        lambda: fia(block_table=None),
        lambda: fia(sparse_mode=4),
        lambda: fia(antiquant_scale=torch.ones(2)),
        lambda: fia(softmax_lse_flag=True),
        lambda: scatter(seq_lens=torch.tensor([3], dtype=torch.int32)),
        lambda: gather(seq_offset=torch.zeros(2, dtype=torch.int32)),
        lambda: load(seq_starts=torch.zeros(2, dtype=torch.int32)),
    ],
)
def test_documented_but_unmodelled_features_refuse_to_compute(make) -> None:
    with pytest.raises(NotModelled):
        make().run()


def test_moe_ops_compute_the_routed_experts() -> None:
    """Gating, routing, two grouped matmuls around SwiGLU and the unpermute: each token's top-2 experts, weighted."""
    standin = make_torch_npu_standin()
    x, w13, w2 = _bf16(5, HID).float(), _bf16(E, HID, 64).float(), _bf16(E, 32, HID).float()
    weights, ids, _ = standin.npu_moe_gating_top_k_softmax(x[:, :E].contiguous(), k=TOP_K)
    rows, row_idx, counts, _ = standin.npu_moe_init_routing_v2(
        x, ids, active_num=10, expert_num=E, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, E], quant_mode=-1)
    assert counts.tolist() == torch.bincount(ids.flatten().long(), minlength=E).tolist()
    hidden = standin.npu_grouped_matmul(x=[rows], weight=[w13], split_item=2, group_type=0, group_list_type=1, group_list=counts)[0]
    down = standin.npu_grouped_matmul(x=[standin.npu_swiglu(hidden)], weight=[w2], split_item=2, group_type=0,
                                      group_list_type=1, group_list=counts)[0]
    out = standin.npu_moe_token_unpermute(permuted_tokens=down.bfloat16(), sorted_indices=row_idx, probs=weights.bfloat16())
    gate, up = (x[:, None, None, :] @ w13[ids.long()]).squeeze(2).chunk(2, dim=-1)
    expected = ((torch.nn.functional.silu(gate) * up)[:, :, None, :] @ w2[ids.long()]).squeeze(2)
    expected = (expected * weights[..., None]).sum(1)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=1e-2 * float(expected.abs().max()))  # bf16 tokens


def test_routing_over_an_expert_range_routes_those_experts_pairs_alone() -> None:
    """An expert-parallel rank's call: the range's pairs first, by expert; the others' gather index -1 and their rows
    undefined (NaN here, so a caller that reads them shows it); counts of the range's experts alone."""
    x = _bf16(5, HID)
    rows, row_idx, counts, _ = routing(x=x, active_expert_range=[1, 3]).run()
    flat = IDS.flatten().long()
    mine = ((flat >= 1) & (flat < 3)).nonzero().flatten()
    assert counts.tolist() == [int((flat == 1).sum()), int((flat == 2).sum())]
    assert bool((row_idx[(flat < 1) | (flat >= 3)] == -1).all()) and sorted(row_idx[mine].tolist()) == list(range(len(mine)))
    for pair in mine.tolist():
        assert torch.equal(rows[int(row_idx[pair])], x[pair // TOP_K])
    assert bool(rows[len(mine):].isnan().all())


def test_fia_v2_mla_decode_computes_latent_attention() -> None:
    call = fia2()
    out, _ = call.run()
    a = call.args
    assert out.shape == (4, 2, 1, 512)  # NBSD
    for b, (blocks, n) in enumerate(((a["block_table"][0], 130), (a["block_table"][1], 5))):
        latent = a["key"][blocks.long(), 0].flatten(0, 1)[:n].float()
        rope = a["key_rope"][blocks.long(), 0].flatten(0, 1)[:n].float()
        scores = (a["query"][b, :, 0].float() @ latent.T + a["query_rope"][b, :, 0].float() @ rope.T) * 0.07
        torch.testing.assert_close(out[:, b, 0].float(), scores.softmax(-1) @ latent, rtol=2e-2, atol=2e-2)


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        fia(scale_value=0.1).run()  # the pre-2.x name of ``scale``


def test_calls_are_recorded_in_order() -> None:
    standin = make_torch_npu_standin()
    args = scatter().args
    standin.npu_scatter_pa_kv_cache(**args)
    standin.npu.synchronize()
    assert standin.calls == ["npu_scatter_pa_kv_cache", "npu.synchronize"]


# -- graph mode: ACLGraph capture, task groups and their updates (vllm-ascend's full-graph attention) -----


@dataclass
class GraphFlow:
    """vllm-ascend's full-graph attention on a fresh stand-in: capture FIA as a task group, update it, replay.

    ``run`` goes through the whole flow; each ``break_*`` flag changes one step of it.
    """

    kv_lens: tuple[int, int] = (3, 130)  # the lengths the update re-issues the task with
    break_stream: str = ""  # "capture_default", "recapture", "end_elsewhere", "replay_uncaptured", "group_outside",
    # "empty_group", "nested_group", "unclosed_group", "bad_handle", "update_off_stream", "update_other_kernel",
    # "update_twice", "replay_in_update", "end_without_begin", "no_record"
    out: str = ""  # "short", "wrong_shape"
    workspace: str = ""  # "own"

    def run(self):
        t = make_torch_npu_standin()
        npu, kernel = t.npu, t.npu_fused_infer_attention_score.out
        args = fia(decode=True).args
        workspace = t._npu_fused_infer_attention_score_get_max_workspace(**args)
        if self.workspace == "own":
            workspace = torch.empty(64, dtype=torch.uint8)
        out = [torch.empty_like(args["query"]), torch.empty(1, dtype=args["query"].dtype)]
        if self.out == "short":
            out = out[:1]
        elif self.out == "wrong_shape":
            out[0] = out[0][:1]
        graph, event, brk = npu.NPUGraph(), npu.ExternalEvent(), self.break_stream
        if brk == "replay_uncaptured":
            graph.replay()
        if brk == "capture_default":
            graph.capture_begin()
        if brk == "group_outside":
            npu.graph_task_group_begin(npu.current_stream())
        if brk == "end_elsewhere":
            with npu.stream(npu.Stream()):
                graph.capture_begin()
            graph.capture_end()
        with npu.graph(graph):
            stream = npu.current_stream()
            event.wait(stream)
            event.reset(stream)
            npu.graph_task_group_begin(stream)
            if brk == "nested_group":
                npu.graph_task_group_begin(stream)
            if brk != "empty_group":
                kernel(**args, workspace=workspace, out=out)
            if brk != "unclosed_group":
                handle = npu.graph_task_group_end(stream)
        if brk == "recapture":
            with npu.graph(graph):
                pass
        update = npu.Stream()
        with npu.stream(None if brk == "update_off_stream" else update):
            if brk == "end_without_begin":
                npu.graph_task_update_end(update)
            npu.graph_task_update_begin(update, "handle" if brk == "bad_handle" else handle)
            changed = args | {"actual_seq_lengths_kv": list(self.kv_lens)}
            if brk == "update_other_kernel":
                t.npu_fused_infer_attention_score(**changed)
            else:
                kernel(**changed, workspace=workspace, out=out)
            if brk == "update_twice":
                kernel(**changed, workspace=workspace, out=out)
            if brk == "replay_in_update":
                graph.replay()
            npu.graph_task_update_end(update)
            if brk != "no_record":
                event.record(update)
        graph.replay()
        return out[0], graph


GRAPH_VIOLATIONS: list[tuple[str, Callable[[], GraphFlow]]] = [
    ("graph.capture_stream", lambda: GraphFlow(break_stream="capture_default")),
    ("graph.recapture", lambda: GraphFlow(break_stream="recapture")),
    ("graph.capture_end_stream", lambda: GraphFlow(break_stream="end_elsewhere")),
    ("graph.replay_uncaptured", lambda: GraphFlow(break_stream="replay_uncaptured")),
    ("graph.event_unrecorded", lambda: GraphFlow(break_stream="no_record")),
    ("task_group.in_capture", lambda: GraphFlow(break_stream="group_outside")),
    ("task_group.one_kernel", lambda: GraphFlow(break_stream="empty_group")),
    ("task_group.one_kernel", lambda: GraphFlow(break_stream="nested_group")),
    ("task_group.one_kernel", lambda: GraphFlow(break_stream="unclosed_group")),
    ("task_update.handle", lambda: GraphFlow(break_stream="bad_handle")),
    ("task_update.stream", lambda: GraphFlow(break_stream="update_off_stream")),
    ("task_update.one_kernel", lambda: GraphFlow(break_stream="update_other_kernel")),
    ("task_update.one_kernel", lambda: GraphFlow(break_stream="update_twice")),
    ("task_update.one_kernel", lambda: GraphFlow(break_stream="replay_in_update")),
    ("task_update.one_kernel", lambda: GraphFlow(break_stream="end_without_begin")),
    ("fia_out.out", lambda: GraphFlow(out="short")),
    ("fia_out.out", lambda: GraphFlow(out="wrong_shape")),
    ("fia_out.workspace", lambda: GraphFlow(workspace="own")),
]


@pytest.mark.parametrize("rule_id,make", GRAPH_VIOLATIONS, ids=[_case_id(c) for c in GRAPH_VIOLATIONS])
def test_each_documented_graph_misuse_is_rejected(rule_id: str, make: Callable[[], GraphFlow]) -> None:
    with pytest.raises(ContractViolation) as err:
        make().run()
    assert err.value.rule.id == rule_id, str(err.value)
    assert RULES[rule_id].quote in str(err.value) and RULES[rule_id].source in str(err.value)


def test_a_replay_runs_the_task_with_the_lengths_of_its_last_update() -> None:
    """What the update mechanism is for: the graph keeps the captured host lengths until a task update replaces them."""
    captured = fia(decode=True).run()[0]  # the capture's lengths: contexts of 3 and 130 tokens
    shorter = fia(decode=True, actual_seq_lengths_kv=[3, 100]).run()[0]
    assert not torch.equal(captured, shorter)
    replayed, graph = GraphFlow(kv_lens=(3, 100)).run()
    torch.testing.assert_close(replayed, shorter, atol=0, rtol=0)
    assert graph.replays == 1
    not_updated, _ = GraphFlow(kv_lens=(3, 130)).run()
    torch.testing.assert_close(not_updated, captured, atol=0, rtol=0)


def test_a_replay_reruns_captured_work_on_the_memory_as_it_is_now() -> None:
    """Tensors are read at replay (static buffers refilled before it); host values were fixed at capture."""
    npu = make_torch_npu_standin().npu
    x, graph = torch.ones(4), npu.NPUGraph()
    with npu.graph(graph):
        y = x * 2 + float(x.sum())  # the sum is read on the host at capture: a constant of the graph
    x.fill_(3)
    graph.replay()
    assert y.tolist() == [10.0] * 4 and graph.replays == 1
