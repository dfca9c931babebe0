"""The npu backend: torch_npu's paged-KV kernels, called the way their documentation specifies.

Which op does what (signatures from the torch-npu 2.13.0 wheel; vllm-ascend makes the same calls):

- write: ``npu_scatter_pa_kv_cache(key=, value=, key_cache=, value_cache=, slot_mapping=,
  cache_mode="Norm")``; ``_npu_reshape_and_cache`` where the installed torch_npu lacks it.
  ``cache_mode`` must be given: its default, "PA_NZ", expects NZ-format caches, ours are ND.
- prefill, chunked prefill and mixed batches: ``npu_fused_infer_attention_score`` (FIA) with the
  query packed as TND, the caches viewed as ``[num_blocks, block_size, Hkv*D]`` (BnBsH),
  ``block_table`` int32, ``actual_seq_lengths`` = cumulative query ends and
  ``actual_seq_lengths_kv`` = per-sequence context lengths (host int lists), and the compressed
  2048x2048 causal mask (True above the diagonal) with ``sparse_mode=3`` (right-down causal: the
  queries sit at the end of their context).
- pure decode: ATB's ``_npu_paged_attention`` (context_lens an int32 host tensor), when the block
  size is one it takes (<= 128); FIA otherwise.
- gather: ``npu_gather_pa_kv_cache``, or ``atb.npu_paged_cache_load`` on versions without it.
- timing: ``torch_npu.npu.Event(enable_timing=True)``; memory: ``torch_npu.npu.memory_allocated``.
- MoE (``moe_experts``): vllm-ascend's all-gather MoE chain, gating top-k softmax, init routing v2,
  two grouped matmuls around SwiGLU, token unpermute (the method names each call's source file).
- MLA (``mla_attention``, vllm-ascend commit 182b75e, vllm_ascend/attention/mla_v1.py): the cache is a
  latent cache and a rope-key cache (written by the same scatter as K/V); decode runs
  ``npu_fused_infer_attention_score_v2`` in its MLA mode (query_rope/key_rope), whose documentation
  takes a latent of 512 or 128 with a rope of 64 (DeepSeek-V2/V3's 512 + 64), page attention, and
  query heads a power of two (vllm-ascend pads them). A model of other latent sizes (the toy
  small-mla's 256 + 32) is refused by that call. Prefill up-projects the latents (``_mla_prefill``).

Block size: FIA with page attention and more than one query token per sequence needs a multiple
of 128 up to 512, so caches are refused at allocation for any other size (vllm-ascend's
``get_supported_kernel_block_sizes()`` is ``[128]`` for the same reason). FIA takes fp16/bf16
queries only, so fp32 caches are refused too. ``npu_preflight`` holds these limits and the
version/ATB checks the constructor runs, so a misconfigured machine fails at start, not mid-run.

int8 KV (C8, static per-channel scales, ``kv_quant``): K/V are quantised in torch and scattered
as int8 into ND caches ("Norm" mode takes int8). Pure decode runs FIA's Q_S = 1 branch on the
int8 cache with separate per-channel antiquant scales (``key_antiquant_scale`` /
``value_antiquant_scale`` of shape (1, H) in the query's dtype, ``key/value_antiquant_mode=0``,
BSH query): the documented combined ``antiquant_scale`` dequantises to float16 only, and
antiquant with Q_S > 1 takes only per-token scales and no page attention. So a step's prefill
sequences dequantise the blocks they read into a compact float cache and run the ordinary TND
call over it, while its decode sequences still take the antiquant call (vllm-ascend's C8 path
splits decodes from prefills the same way and dequantises the cache for chunked prefill).

Importing torch_npu, and ``TORCH_DEVICE_BACKEND_AUTOLOAD``
-----------------------------------------------------------
The torch_npu wheel registers a ``torch.backends`` entry point, so with torch >= 2.5 a plain
``import torch`` imports torch_npu too. On a machine with the wheel but no CANN toolkit
(libhccl.so missing, or set_env.sh not sourced), that import fails and ``import torch`` itself
raises "Failed to load the backend extension: torch_npu" -- taking down the cpu backend, the
simulator's profiling and every test, none of which need an NPU. torch reads the switch once, at
its own first import, so it has to be set before that: ``realexec.backends`` sets
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` on import with ``os.environ.setdefault`` (a user's explicit
value wins), and code that imports torch before importing realexec.backends must do the same.

Turning autoload off loses nothing for kvsim: this module imports torch_npu explicitly, which
registers the NPU device exactly as the autoload would (torch_npu's own ``__init__`` turns the
switch off while it imports torch, then restores the user's value for child processes). On a
machine without CANN the explicit import is where the failure surfaces, as one
``BackendUnavailable`` line, and only for the npu backend.

Graph mode (ACLGraph, as vllm-ascend replays decode): ``npu_graphs.py``. Steps a capture size holds
(the 910B profiles' ``[engine] capture_sizes``) replay as ``torch.npu.NPUGraph`` graphs; attention inside
them is FIA captured as a task group and re-issued with each step's lengths before the replay.

Tests pass a stand-in module (``tests/torch_npu_standin.py``) as ``torch_npu_module`` with ``device="cpu"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from itertools import accumulate
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from kvsim.policies.blocks import cdiv
from kvsim.realexec.backends.base import AttentionMetadata, KernelBackend
from kvsim.realexec.backends.cache_ops import KVCaches, allocate_caches, copy_blocks, swap_blocks
from kvsim.realexec.backends.errors import BackendUnavailable, PreflightFailed
from kvsim.realexec.backends.kv_quant import KVScales, dequantize, quantize, require_scales
from kvsim.realexec.backends.npu_graphs import AttentionTask, NpuStepGraph, graph_attention
from kvsim.realexec.backends.npu_preflight import (
    NPU_COMPUTE_DTYPES,
    PAGED_ATTENTION_MAX_BLOCK,
    PAGED_ATTENTION_MAX_HEAD_SIZE,
    Finding,
    PreflightWarning,
    cache_problems,
    environment_problems,
)
from kvsim.realexec.model import MoeWeights

R = TypeVar("R")

CAUSAL_MASK_SIZE = 2048  # sparse_mode 2/3/4 take the mask compressed to 2048x2048


def import_torch_npu() -> Any:
    """torch_npu, or ``BackendUnavailable`` saying in one line what is missing."""
    try:
        import torch_npu
    except ModuleNotFoundError as err:
        if err.name != "torch_npu":
            raise _unavailable(err) from err
        raise BackendUnavailable(
            f"npu backend unavailable: torch_npu is not installed (pip install torch-npu=={torch.__version__.split('+')[0]})"
        ) from err
    except Exception as err:  # OSError/ImportError from missing CANN libraries, RuntimeError on version mismatch
        raise _unavailable(err) from err
    return torch_npu


def _unavailable(err: BaseException) -> BackendUnavailable:
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return BackendUnavailable(
        f"npu backend unavailable: torch_npu failed to import ({first_line}); "
        "install the CANN toolkit and run 'source /usr/local/Ascend/ascend-toolkit/set_env.sh'"
    )


class NpuBackend(KernelBackend):
    name = "npu"
    needs_batch_blocks_within_pool = True  # FIA: "blocknum >= sum(ceil(seq_len / block_size))"
    profile_block_sizes = (128, 256)  # FIA takes block sizes 128 to 512
    attention_dtypes = NPU_COMPUTE_DTYPES  # FIA/PA queries: float16, bfloat16 (or int8, not used)
    supports_graphs = True  # ACLGraph (npu_graphs.py)
    graph_pad_slot = -1  # vLLM's PAD_SLOT_ID: the scatter skips it (a repeated real slot is undefined)
    process_group = "hccl"  # registered with torch.distributed by torch_npu's import

    def __init__(self, device: str | None = None, torch_npu_module: Any = None) -> None:
        self.torch_npu = torch_npu_module if torch_npu_module is not None else import_torch_npu()
        runtime = self.torch_npu.npu
        if not runtime.is_available():
            raise BackendUnavailable("npu backend unavailable: torch_npu imported but sees no NPU device")
        self.device = torch.device(device or f"npu:{runtime.current_device()}")
        self.write_op = (
            "npu_scatter_pa_kv_cache"
            if hasattr(self.torch_npu, "npu_scatter_pa_kv_cache")
            else "_npu_reshape_and_cache"
        )
        self.gather_op = (
            "npu_gather_pa_kv_cache"
            if hasattr(self.torch_npu, "npu_gather_pa_kv_cache")
            else "atb.npu_paged_cache_load"
        )
        self._causal_mask: torch.Tensor | None = None
        self._expert_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # MoE layer -> grouped-matmul layout
        self._update_stream: Any = None
        # While a graph is being captured: the attention tasks its FIA calls record (npu_graphs.graph_attention).
        self.recording_tasks: list[AttentionTask] | None = None
        self.preflight_warnings = _raise_errors(environment_problems(self.torch_npu), "npu backend unavailable")

    def default_profile(self) -> str:
        return "ascend-910b3"

    def new_graph_pool(self) -> Any:
        return self.torch_npu.npu.graph_pool_handle()  # vllm-ascend: one pool for all its ACLGraphWrapper entries

    def new_graph(self, pool: Any) -> NpuStepGraph:
        return NpuStepGraph(self, pool)

    def update_stream(self) -> Any:
        """The stream captured attention tasks are re-issued on before a replay (vllm-ascend's ``update_stream``)."""
        if self._update_stream is None:
            self._update_stream = self.torch_npu.npu.Stream()
        return self._update_stream

    def machine_name(self) -> str:
        return str(self.torch_npu.npu.get_device_name(self.device.index or 0))

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
        value_head_size: int | None = None,
    ) -> KVCaches:
        sizes = dict.fromkeys((head_size, head_size if value_head_size is None else value_head_size))
        for size in sizes:
            self.preflight_warnings += _raise_errors(
                cache_problems(dtype, block_size, num_kv_heads, size), "npu backend: KV cache unsupported", ValueError
            )
        return allocate_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, self.device,
                               value_head_size=value_head_size)

    def allocate_host_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
        value_head_size: int | None = None,
    ) -> KVCaches:
        pin = self.device.type != "cpu"  # pinned host memory needs a device to pin for
        return allocate_caches(
            num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, "cpu", pin_memory=pin,
            value_head_size=value_head_size,
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales | None = None,
    ) -> None:
        quant = require_scales(key_cache, kv_scales)
        if quant is not None:
            key, value = quantize(key, quant.key), quantize(value, quant.value)
        slots = slot_mapping.to(torch.int32).contiguous()
        if self.write_op == "npu_scatter_pa_kv_cache":
            self.torch_npu.npu_scatter_pa_kv_cache(
                key=key.contiguous(),
                value=value.contiguous(),
                key_cache=key_cache,
                value_cache=value_cache,
                slot_mapping=slots,
                cache_mode="Norm",
            )
        else:
            self.torch_npu._npu_reshape_and_cache(
                key=key.contiguous(),
                value=value.contiguous(),
                key_cache=key_cache,
                value_cache=value_cache,
                slot_indices=slots,
            )

    def attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        quant = require_scales(key_cache, kv_scales)
        query = query.contiguous()
        if meta.captured:  # inside an ACL graph: FIA as an updatable task (the executor captures no int8 steps)
            return graph_attention(self, query, key_cache, value_cache, meta, scale)
        if quant is not None:
            return self._int8_attention(query, key_cache, value_cache, meta, scale, quant)
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
        num_heads = query.shape[1]
        paged_attention_fits = block_size <= PAGED_ATTENTION_MAX_BLOCK and head_size <= PAGED_ATTENTION_MAX_HEAD_SIZE
        if meta.is_decode_only and paged_attention_fits:
            out = torch.empty_like(query)
            self.torch_npu._npu_paged_attention(
                query=query,
                key_cache=key_cache,
                value_cache=value_cache,
                num_kv_heads=num_kv_heads,
                num_heads=num_heads,
                scale_value=scale,
                block_table=meta.block_tables,
                context_lens=meta.memo("npu.context_lens", lambda: torch.tensor(meta.seq_lens_list, dtype=torch.int32)),
                out=out,
            )
            return out
        out, _ = self.torch_npu.npu_fused_infer_attention_score(
            query,
            key_cache.view(num_blocks, block_size, -1),
            value_cache.view(num_blocks, block_size, -1),
            atten_mask=self._mask(),
            block_table=meta.block_tables,
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=meta.memo("npu.query_ends", lambda: list(accumulate(meta.query_lens_list))),
            actual_seq_lengths_kv=meta.seq_lens_list,
            num_key_value_heads=num_kv_heads,
            num_heads=num_heads,
            scale=scale,
            sparse_mode=3,
        )
        return out

    def mla_attention(
        self,
        query: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """MLA as vllm-ascend's AscendMLAImpl splits it (vllm_ascend/attention/mla_v1.py): decode sequences
        absorbed through FIA v2's MLA mode, prefill sequences over their latents up-projected (module docstring)."""
        parts = meta.memo("npu.mla_parts", lambda: _decode_and_prefill_parts(meta))
        out = query.new_empty(query.shape[0], query.shape[1], w_uv.shape[1])
        for rows, part in parts:
            q = query if len(parts) == 1 else query.index_select(0, rows)
            if part.is_decode_only:
                part_out = self._mla_decode(q, latent_cache, rope_cache, part, scale, w_uk, w_uv)
            else:
                part_out = self._mla_prefill(q, latent_cache, rope_cache, part, scale, w_uk, w_uv)
            out.index_copy_(0, rows, part_out)
        return out

    def _mla_decode(
        self,
        query: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """Absorbed decode, AscendMLAImpl._forward_decode's non-speculative ND branch: q_nope @ W_UK, then
        ``npu_fused_infer_attention_score_v2(q_nope, k_nope, k_nope, query_rope=, key_rope=, input_layout=
        "BNSD_NBSD", sparse_mode=0, no mask)`` over the paged latents viewed (blocks, 1, block_size, D), heads
        zero-padded to a power of two as vllm-ascend pads them, then the output @ W_UV (its _v_up_proj)."""
        batch, num_heads, _ = query.shape
        nope, latent = w_uk.shape[1], w_uk.shape[2]
        block_size, rope = latent_cache.shape[1], rope_cache.shape[-1]
        padded = 1 << (num_heads - 1).bit_length()  # mla_v1.py: num_heads_padded
        q_nope = torch.einsum("bhn,hnl->bhl", query[..., :nope], w_uk.to(query.dtype))
        q_nope = F.pad(q_nope, (0, 0, 0, padded - num_heads)).view(batch, padded, 1, latent).contiguous()
        q_pe = F.pad(query[..., nope:], (0, 0, 0, padded - num_heads)).view(batch, padded, 1, rope).contiguous()
        k_nope = latent_cache.view(-1, 1, block_size, latent)
        out, _ = self.torch_npu.npu_fused_infer_attention_score_v2(
            q_nope,
            k_nope,
            k_nope,
            query_rope=q_pe,
            key_rope=rope_cache.view(-1, 1, block_size, rope),
            num_query_heads=padded,
            num_key_value_heads=1,
            input_layout="BNSD_NBSD",
            atten_mask=None,
            sparse_mode=0,
            softmax_scale=scale,
            block_table=meta.block_tables,
            block_size=block_size,
            actual_seq_kvlen=meta.seq_lens_list,
        )
        latent_out = out[:num_heads].view(num_heads, batch, latent).transpose(0, 1)
        return torch.einsum("bhl,hvl->bhv", latent_out, w_uv.to(query.dtype))

    def _mla_prefill(
        self,
        query: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """Naive prefill: the blocks each sequence reads, up-projected to per-head K = [k_nope, k_pe] and V, in a
        compact paged cache, through the same FIA TND call as per-head attention. That call takes K and V of
        one shape, so V is zero-padded to K's size and the output cut back (what vLLM's MLA does for kernels
        without distinct V sizes). vllm-ascend instead runs FIA on the new tokens' K/V and merges the cached
        context chunk by chunk (npu_attention_update): the same attention, more kernels."""
        blocks, compact = meta.memo("npu.mla_compact", lambda: _compact_tables(meta))
        num_heads, v_size = w_uv.shape[0], w_uv.shape[1]
        latent = latent_cache.index_select(0, blocks)[:, :, 0]  # [n, block_size, kv_lora_rank]
        rope = rope_cache.index_select(0, blocks)  # [n, block_size, 1, rope]
        keys = torch.cat([torch.einsum("nsl,hdl->nshd", latent, w_uk.to(latent.dtype)),
                          rope.expand(-1, -1, num_heads, -1)], dim=-1).contiguous()
        values = torch.einsum("nsl,hvl->nshv", latent, w_uv.to(latent.dtype))
        values = F.pad(values, (0, keys.shape[-1] - v_size)).contiguous()
        return self.attention(query.contiguous(), keys, values, compact, scale)[..., :v_size]

    def moe_experts(self, hidden: torch.Tensor, router_logits: torch.Tensor, moe: MoeWeights, top_k: int) -> torch.Tensor:
        """The routed experts through the ops vllm-ascend's single-device (all-gather) MoE path calls:

        - ``npu_moe_gating_top_k_softmax(router_logits, k=top_k)``, the weights then renormalised
          (vllm_ascend/_310p/fused_moe/grouped_topk_router.py; model.route's rule);
        - ``npu_moe_init_routing_v2(hidden, topk_ids, active_num=, expert_num=, expert_tokens_num_type=1,
          expert_tokens_num_flag=True, active_expert_range=, quant_mode=-1)``: tokens sorted by expert, counts
          per expert (vllm_ascend/ops/fused_moe/token_dispatcher.py, TokenDispatcherWithAllGather, through
          vllm_ascend/device/device_op.py);
        - ``npu_grouped_matmul(x=[...], weight=[w], split_item=2, group_list_type=1, group_type=0, group_list=)``
          twice around ``npu_swiglu``, with expert weights stored [E, in, out] (vllm_ascend/_310p/fused_moe/
          moe_mlp.py unquant_apply_mlp; fused_moe.py transposes w13/w2 so at load);
        - ``npu_moe_token_unpermute(permuted_tokens=, sorted_indices=abs(expanded_row_idx), probs=topk_weights)``
          (token_dispatcher.py token_combine, device_op.py). Its documentation takes bfloat16 tokens and
          probabilities only, so an fp16 model's rows are combined in bfloat16.

        An expert-parallel rank (``w13`` holds E / EP experts from ``moe.first_expert``) runs the same chain as
        vllm-ascend's all-gather dispatcher with an expert map: the other ranks' pairs get weight 0
        (``topk_weights * mask``) and ``active_expert_range`` keeps the rank's own, which come first in the
        routed rows, with -1 as the others' row index. The grouped matmuls take exactly those rows: their
        documentation has the counts sum to x's rows (vllm-ascend passes every row). The rows after them, whose
        content the routing documentation leaves undefined, are zeros for the unpermute, where the others'
        pairs point (``abs(-1)``) at weight 0. That count is read on the host, so these steps do not go into
        a graph (tensor-parallel ranks run eagerly, realexec/tp_executor.py).
        """
        tnpu, num_tokens = self.torch_npu, hidden.shape[0]
        w13, w2 = self._grouped_weights(moe)
        num_experts, here, first = router_logits.shape[1], w13.shape[0], moe.first_expert
        weights, ids, _ = tnpu.npu_moe_gating_top_k_softmax(router_logits.contiguous(), k=top_k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if here < num_experts:  # expert parallel: this rank's pairs alone
            weights = weights * ((ids >= first) & (ids < first + here))
        rows, expanded_row_idx, counts, _ = tnpu.npu_moe_init_routing_v2(
            hidden.contiguous(), ids, active_num=num_tokens * top_k, expert_num=num_experts, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[first, first + here], quant_mode=-1,
        )
        counts = counts.to(torch.int64)
        if here == num_experts:
            down = self._expert_mlps(rows, counts, w13, w2)
        else:
            mine = int(counts.sum())
            down = rows.new_zeros(rows.shape[0], w2.shape[2])
            if mine:
                down[:mine] = self._expert_mlps(rows[:mine], counts, w13, w2)
        combined = tnpu.npu_moe_token_unpermute(permuted_tokens=down.to(torch.bfloat16),
                                                sorted_indices=torch.abs(expanded_row_idx),
                                                probs=weights.to(torch.bfloat16))
        return combined.to(hidden.dtype)

    def _expert_mlps(self, rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Each expert's rows (``counts`` of them, in order) through its gate/up matmul, SwiGLU and down matmul."""
        tnpu = self.torch_npu
        gate_up = tnpu.npu_grouped_matmul(x=[rows], weight=[w13], split_item=2, group_list_type=1, group_type=0,
                                          group_list=counts)[0]
        return tnpu.npu_grouped_matmul(x=[tnpu.npu_swiglu(gate_up)], weight=[w2], split_item=2, group_list_type=1,
                                       group_type=0, group_list=counts)[0]

    def _grouped_weights(self, moe: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's expert weights as grouped matmul takes them, [E, in, out], transposed once per layer."""
        key = id(moe)
        if key not in self._expert_weights:
            self._expert_weights[key] = (moe.w13.transpose(1, 2).contiguous(), moe.w2.transpose(1, 2).contiguous())
        return self._expert_weights[key]

    def _int8_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        quant: KVScales,
    ) -> torch.Tensor:
        """Decode sequences on the int8 cache through FIA's antiquant; prefills over their blocks dequantised."""
        parts = meta.memo("npu.int8_parts", lambda: _decode_and_prefill_parts(meta))
        if len(parts) == 1:
            return self._int8_part(query, key_cache, value_cache, parts[0][1], scale, quant)
        out = torch.empty_like(query)
        for rows, part in parts:
            part_out = self._int8_part(query.index_select(0, rows), key_cache, value_cache, part, scale, quant)
            out.index_copy_(0, rows, part_out)
        return out

    def _int8_part(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        quant: KVScales,
    ) -> torch.Tensor:
        if meta.is_decode_only:
            return self._int8_decode(query, key_cache, value_cache, meta, scale, quant)
        keys, values, compact = self._dequantised(key_cache, value_cache, meta, quant, query.dtype)
        return self.attention(query, keys, values, compact, scale)

    def _int8_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        quant: KVScales,
    ) -> torch.Tensor:
        """FIA's Q_S = 1 branch over the int8 cache, dequantised in-kernel by per-channel antiquant scales."""
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
        batch, num_heads, _ = query.shape

        def scale_row(s: torch.Tensor) -> torch.Tensor:  # per-channel, BSH: (1, H) in the query's dtype
            return s.reshape(1, num_kv_heads * head_size).to(query.dtype).contiguous()

        out, _ = self.torch_npu.npu_fused_infer_attention_score(
            query.view(batch, 1, num_heads * head_size),
            key_cache.view(num_blocks, block_size, -1),
            value_cache.view(num_blocks, block_size, -1),
            block_table=meta.block_tables,
            input_layout="BSH",
            block_size=block_size,
            actual_seq_lengths_kv=meta.seq_lens_list,
            num_key_value_heads=num_kv_heads,
            num_heads=num_heads,
            scale=scale,
            key_antiquant_scale=meta.memo(f"npu.k_antiquant.{id(quant)}", lambda: scale_row(quant.key)),
            value_antiquant_scale=meta.memo(f"npu.v_antiquant.{id(quant)}", lambda: scale_row(quant.value)),
            key_antiquant_mode=0,
            value_antiquant_mode=0,
        )
        return out.view(batch, num_heads, head_size)

    def _dequantised(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        quant: KVScales,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The blocks each sequence reads, dequantised into a compact cache, and metadata addressing it.

        Sequence ``b``'s blocks are laid out one after another (a block two sequences share is
        copied for each), so the compact cache holds exactly FIA's ``sum(ceil(seq_len / block_size))``.
        """
        blocks, compact = meta.memo("npu.int8_compact", lambda: _compact_tables(meta))
        keys = dequantize(key_cache.index_select(0, blocks), quant.key, dtype)
        values = dequantize(value_cache.index_select(0, blocks), quant.value, dtype)
        return keys, values, compact

    def _mask(self) -> torch.Tensor:
        """The compressed right-down causal mask: True (masked) strictly above the diagonal; built once."""
        if self._causal_mask is None:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=self.device)
            self._causal_mask = torch.triu(ones, diagonal=1)
        return self._causal_mask

    def gather_kv(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tables, lens = block_tables.to(torch.int32), seq_lens.to(torch.int32)
        if self.gather_op == "atb.npu_paged_cache_load":
            return self.torch_npu.atb.npu_paged_cache_load(key_cache, value_cache, tables, lens)
        total = int(lens.sum())
        key = key_cache.new_empty(total, *key_cache.shape[2:])
        value = value_cache.new_empty(total, *value_cache.shape[2:])
        self.torch_npu.npu_gather_pa_kv_cache(key_cache, value_cache, tables, lens, key, value)
        return key, value

    def copy_blocks(self, kv_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        copy_blocks(kv_caches, pairs)

    def swap(self, src_caches: KVCaches, dst_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        swap_blocks(src_caches, dst_caches, pairs, non_blocking=True)

    def device_count(self) -> int:
        return int(self.torch_npu.npu.device_count())

    def make_current(self) -> None:
        self.torch_npu.npu.set_device(self.device)

    def synchronize(self) -> None:
        self.torch_npu.npu.synchronize(self.device)

    def memory_in_use(self) -> int:
        return int(self.torch_npu.npu.memory_allocated(self.device))

    def elapsed(self, fn: Callable[[], R]) -> tuple[R, float]:
        event = self.torch_npu.npu.Event
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end) / 1e3


def _raise_errors(
    findings: list[Finding], heading: str, error: type[Exception] = PreflightFailed
) -> list[str]:
    """Raise every error finding at once (one line each); warn about the rest and return their messages."""
    errors = [f.message for f in findings if f.error]
    if errors:
        if len(errors) == 1:
            raise error(f"{heading}: {errors[0]}")
        raise error(heading + ":\n" + "\n".join(f"  - {m}" for m in errors))
    for finding in findings:
        warnings.warn(finding.message, PreflightWarning, stacklevel=3)
    return [f.message for f in findings]


def _compact_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    """(block ids to copy, in order; metadata of the same step over the compact cache they form)."""
    tables = meta.block_tables.cpu()
    counts = [cdiv(s, meta.block_size) for s in meta.seq_lens_list]
    blocks = torch.cat([tables[b, :n] for b, n in enumerate(counts)]).long()
    starts = [0, *accumulate(counts)]
    compact_rows = [list(range(starts[b], starts[b + 1])) for b in range(len(counts))]
    compact = AttentionMetadata.build(
        meta.query_lens_list, meta.seq_lens_list, compact_rows, meta.block_size, meta.block_tables.device
    )
    return blocks.to(meta.block_tables.device), compact


def _decode_and_prefill_parts(meta: AttentionMetadata) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """(query rows, metadata) of the step's decode sequences and of its prefill sequences, each if any."""
    tables = meta.block_tables.cpu()
    starts = [0, *accumulate(meta.query_lens_list)]
    parts = []
    for decode in (True, False):
        seqs = [b for b, q in enumerate(meta.query_lens_list) if (q == 1) == decode]
        if not seqs:
            continue
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in seqs]).to(meta.block_tables.device)
        part = AttentionMetadata.build(
            [meta.query_lens_list[b] for b in seqs],
            [meta.seq_lens_list[b] for b in seqs],
            [tables[b, : cdiv(meta.seq_lens_list[b], meta.block_size)].tolist() for b in seqs],
            meta.block_size,
            meta.block_tables.device,
            meta.slot_mapping.dtype,
        )
        parts.append((rows, part))
    return parts
