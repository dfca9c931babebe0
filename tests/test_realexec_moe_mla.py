"""The real executor on mixture-of-experts and latent-attention (MLA) models (cpu backend).

Toy-width twins of the bundled small-moe and small-mla models (same layout: routed + shared
experts, top-2; latent + rope-key cache, absorbed decode) keep these tests fast. The executor's
paged, routed path must reproduce the dense reference: every latent up-projected to per-head K
and V, every expert run on every token.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from kvsim.policies.plan import PlanEntry, StepPlan  # noqa: E402
from kvsim.policies.request import Request  # noqa: E402
from kvsim.realexec.backends import get_backend  # noqa: E402
from kvsim.realexec.backends.base import AttentionMetadata  # noqa: E402
from kvsim.realexec.backends.portable import paged_latent_attention  # noqa: E402
from kvsim.realexec.executor import Executor  # noqa: E402
from kvsim.realexec.model import DecoderModel, route, routed_experts  # noqa: E402
from kvsim.realexec.prompts import prompt_tokens  # noqa: E402
from kvsim.realexec.reference import causal_attend, dense_experts, dense_generate  # noqa: E402
from kvsim.realexec.weights import load_weights, random_weights, save_weights, weight_shapes  # noqa: E402
from kvsim.sim.perf.model_spec import load_model  # noqa: E402

BS = 16
SEED = 0
MOE = dataclasses.replace(load_model("small-moe"), hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                          moe_intermediate_size=64, shared_expert_intermediate_size=64, vocab_size=512, max_position=256)
MLA = dataclasses.replace(load_model("small-mla"), hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=48,
                          intermediate_size=256, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                          v_head_dim=32, vocab_size=512, max_position=256)
MODELS = {"moe": MOE, "mla": MLA, "mla-q-lora": dataclasses.replace(MLA, q_lora_rank=96),
          "moe-dense-first": dataclasses.replace(MOE, dense_layers=1, intermediate_size=256)}


def _plan(step: int, entries: list[tuple[str, int, int, bool]], tables: dict[str, list[int]]) -> StepPlan:
    slots = [tables[rid][p // BS] * BS + p % BS for rid, first, n, _ in entries for p in range(first, first + n)]
    return StepPlan(step=step, entries=[PlanEntry(rid, first, n, n > 1 or not s, s) for rid, first, n, s in entries],
                    block_tables={rid: list(tables[rid]) for rid, *_ in entries}, slot_mapping=slots)


@pytest.mark.parametrize("name", list(MODELS))
def test_paged_generation_matches_the_dense_reference(name: str) -> None:
    """Chunked prefill beside a decode, then batched decodes: the same greedy tokens as dense recomputation."""
    spec = MODELS[name]
    ex = Executor(spec, get_backend("cpu"), num_blocks=24, block_size=BS, seed=SEED, check=True, timing_repeats=1)
    requests = [Request("a", 0, 0.0, 21, 8), Request("b", 1, 0.0, 37, 8)]
    for r in requests:
        ex.add_request(r)
    tables = {"a": [3, 9], "b": [5, 1, 17]}
    ex.step(_plan(0, [("a", 0, 21, True), ("b", 0, 16, False)], tables))
    ex.step(_plan(1, [("a", 21, 1, True), ("b", 16, 21, True)], tables))
    for step in range(2, 7):
        entries = [(rid, r.prompt_tokens + len(ex.tokens(rid)) - 1, 1, True) for rid, r in zip("ab", requests)]
        ex.step(_plan(step, entries, tables))
    for r in requests:
        prompt = prompt_tokens(r, spec.vocab_size, SEED)
        assert ex.tokens(r.request_id) == dense_generate(ex.model, prompt, len(ex.tokens(r.request_id)))


@pytest.mark.parametrize("name", ["moe", "mla"])
def test_paged_logits_agree_with_the_reference(name: str) -> None:
    """A prompt's prefill then one decode token through the paged pool: the decode row's logits equal the
    dense reference's last row (MLA: the absorbed decode against the up-projected reference)."""
    spec = MODELS[name]
    ex = Executor(spec, get_backend("cpu"), num_blocks=8, block_size=BS, seed=SEED)
    ids = torch.randint(0, spec.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    table = [[6, 2]]
    with torch.inference_mode():
        for first, n in ((0, 29), (29, 1)):
            meta = AttentionMetadata.build([n], [first + n], table, BS)
            hidden = ex.model.forward(ids[first : first + n], torch.arange(first, first + n), ex._paged_attend(meta),
                                      ex.backend.moe_experts)
        paged = ex.model.logits(hidden[-1:])
        dense = ex.model.logits(ex.model.forward(ids, torch.arange(30), causal_attend(ex.model, 30), dense_experts)[-1:])
    assert not paged.isnan().any()
    torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-4)


def test_the_mla_pool_holds_latents_at_the_memory_models_bytes_per_block() -> None:
    spec = load_model("small-mla")
    ex = Executor(spec, get_backend("cpu"), num_blocks=4, block_size=BS, seed=SEED)
    latent, rope = ex.kv_caches[0]
    assert latent.shape[1:] == (BS, 1, spec.kv_lora_rank) and rope.shape[1:] == (BS, 1, spec.qk_rope_head_dim)
    per_block = sum(k.nbytes + v.nbytes for k, v in ex.kv_caches) // ex.num_blocks
    assert per_block == spec.bytes_per_block(BS) == BS * spec.num_layers * (256 + 32) * 4


def test_routing_touches_only_the_picked_experts() -> None:
    """Top-2 of softmax, renormalised; experts no token picked are never computed (their weights are NaN here)."""
    model = DecoderModel.build(MOE, seed=SEED)
    moe = model.layers[0].moe
    hidden = torch.randn(3, MOE.hidden_size, generator=torch.Generator().manual_seed(2))
    logits = hidden @ moe.router.T
    weights, ids = route(logits, 2)
    assert torch.equal(ids, logits.topk(2).indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))
    untouched = sorted(set(range(MOE.num_experts)) - set(ids.flatten().tolist()))
    assert untouched, "three tokens of top-2 leave some of 8 experts idle"
    poisoned = dataclasses.replace(moe, w13=moe.w13.clone(), w2=moe.w2.clone())
    poisoned.w13[untouched] = float("nan")
    poisoned.w2[untouched] = float("nan")
    out = routed_experts(hidden, logits, poisoned, 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, dense_experts(hidden, logits, moe, 2))


def test_routing_spreads_over_the_experts() -> None:
    """The seeded router does not collapse: a prompt's tokens pick every expert, none takes half the picks."""
    model = DecoderModel.build(load_model("small-moe"), seed=SEED)
    ids = torch.randint(0, 4096, (256,), generator=torch.Generator().manual_seed(3))
    picks = torch.bincount(route(model.embed[ids] @ model.layers[0].moe.router.T, 2)[1].flatten(), minlength=8)
    assert (picks > 0).all() and picks.max() < picks.sum() / 2


@pytest.mark.parametrize("name", ["moe", "mla-q-lora"])
def test_seeded_weights_are_deterministic_and_load_by_hugging_face_name(name: str, tmp_path) -> None:
    spec = MODELS[name]
    first, again, other = random_weights(spec, 7), random_weights(spec, 7), random_weights(spec, 8)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.layers.0.self_attn.o_proj.weight"], other["model.layers.0.self_attn.o_proj.weight"])
    expected = {"moe": ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
                        "model.layers.0.mlp.shared_experts.up_proj.weight"],
                "mla-q-lora": ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                               "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.q_b_proj.weight"]}[name]
    assert set(expected) <= set(weight_shapes(spec))
    save_weights(first, tmp_path / "w.safetensors")
    loaded = load_weights(tmp_path / "w.safetensors", spec)
    assert all(torch.equal(first[k], loaded[k]) for k in first)


def test_what_realexec_does_not_run_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="int8 KV cache under latent attention"):
        Executor(MLA, get_backend("cpu"), num_blocks=4, block_size=BS, kv_dtype="int8")
    with pytest.raises(ValueError, match="w8a8 .W8A8. is simulated only"):
        Executor(dataclasses.replace(MOE, weight_dtype="bf16", quantization="w8a8"), get_backend("cpu"), num_blocks=4, block_size=BS)


# -- the npu backend on the torch_npu stand-in (no NPU here) ---------------------------------------------

NPU_MOE_OPS = ["npu_moe_gating_top_k_softmax", "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu",
               "npu_grouped_matmul", "npu_moe_token_unpermute"]


@pytest.fixture
def npu():
    from torch_npu_standin import make_torch_npu_standin

    from kvsim.realexec.backends.npu import NpuBackend

    standin = make_torch_npu_standin()
    return NpuBackend("cpu", torch_npu_module=standin), standin


def test_npu_moe_runs_vllm_ascends_ops_and_matches_the_portable_experts(npu) -> None:
    backend, standin = npu
    model = DecoderModel.build(dataclasses.replace(MOE, weight_dtype="bf16", kv_dtype="bf16"), seed=SEED)
    moe = model.layers[1].moe
    hidden = torch.randn(6, MOE.hidden_size, generator=torch.Generator().manual_seed(4)).bfloat16()
    logits = hidden @ moe.router.T
    standin.calls.clear()
    out = backend.moe_experts(hidden, logits, moe, 2)
    assert standin.calls == NPU_MOE_OPS
    expected = routed_experts(hidden, logits, moe, 2)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=2e-2 * float(expected.abs().max()))


def test_an_expert_parallel_npu_rank_runs_its_experts_pairs_and_the_ranks_add_up_to_the_layer(npu) -> None:
    """vllm-ascend's all-gather chain with an expert map: each half of the experts on its own rank (the other pairs at
    weight 0, ``active_expert_range`` its experts); each rank's part is the portable path's, and the parts add up."""
    backend, standin = npu
    model = DecoderModel.build(dataclasses.replace(MOE, weight_dtype="bf16", kv_dtype="bf16"), seed=SEED)
    moe = model.layers[1].moe
    hidden = torch.randn(6, MOE.hidden_size, generator=torch.Generator().manual_seed(4)).bfloat16()
    logits = hidden @ moe.router.T
    half = MOE.num_experts // 2
    parts = []
    for first in (0, half):
        rank = dataclasses.replace(moe, w13=moe.w13[first : first + half], w2=moe.w2[first : first + half], first_expert=first)
        standin.calls.clear()
        parts.append(backend.moe_experts(hidden, logits, rank, 2).float())
        assert standin.calls == NPU_MOE_OPS
        expected = routed_experts(hidden, logits, rank, 2).float()
        torch.testing.assert_close(parts[-1], expected, rtol=0, atol=2e-2 * float(expected.abs().max()))
    whole = routed_experts(hidden, logits, moe, 2).float()
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=4e-2 * float(whole.abs().max()))


def _mla_step(backend, latent: int, rope: int, heads: int = 3, nope: int = 32, v: int = 32):
    """Caches holding random latents for a mixed step (two decodes, a chunk over a cached prefix), and its query."""
    gen = torch.Generator().manual_seed(6)
    latent_cache, rope_cache = backend.allocate_kv_cache(1, 6, 128, 1, latent, torch.bfloat16, rope)[0]
    meta = AttentionMetadata.build([1, 1, 20], [130, 7, 150], [[0, 1], [2], [3, 4]], 128, slot_dtype=torch.int32)
    context = AttentionMetadata.build([130, 7, 150], [130, 7, 150], [[0, 1], [2], [3, 4]], 128, slot_dtype=torch.int32)
    backend.write_kv(torch.randn(287, 1, latent, generator=gen).bfloat16(), torch.randn(287, 1, rope, generator=gen).bfloat16(),
                     latent_cache, rope_cache, context.slot_mapping)
    query = torch.randn(22, heads, nope + rope, generator=gen).bfloat16()
    w_uk = (torch.randn(heads, nope, latent, generator=gen) / latent**0.5).bfloat16()
    w_uv = (torch.randn(heads, v, latent, generator=gen) / latent**0.5).bfloat16()
    return query, latent_cache, rope_cache, meta, w_uk, w_uv


@pytest.mark.filterwarnings("ignore::kvsim.realexec.backends.npu_preflight.PreflightWarning")  # 512 > ATB PA's head size
def test_npu_mla_absorbs_decodes_through_fia_v2_and_matches_the_portable_path(npu) -> None:
    """DeepSeek's latent of 512 + rope 64, 3 heads (padded to 4 for FIA v2): decodes absorbed, the chunk up-projected."""
    backend, standin = npu
    query, latent_cache, rope_cache, meta, w_uk, w_uv = _mla_step(backend, 512, 64)
    standin.calls.clear()
    out = backend.mla_attention(query, latent_cache, rope_cache, meta, 0.1, w_uk, w_uv)
    assert standin.calls == ["npu_fused_infer_attention_score_v2", "npu_fused_infer_attention_score"]
    expected = paged_latent_attention(query.float(), latent_cache.float(), rope_cache.float(), meta, 0.1, w_uk.float(), w_uv.float())
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=3e-2 * float(expected.abs().max()))


def test_npu_mla_refuses_latents_fia_v2_does_not_take(npu) -> None:
    """The toy small-mla's 256 + 32 latent is not one FIA v2's MLA mode documents (512 or 128, rope 64)."""
    from torch_npu_standin import ContractViolation

    backend, _ = npu
    query, latent_cache, rope_cache, meta, w_uk, w_uv = _mla_step(backend, 256, 32)
    with pytest.raises(ContractViolation, match="fia2.mla_d"):
        backend.mla_attention(query, latent_cache, rope_cache, meta, 0.1, w_uk, w_uv)
