"""The cuda backend: paged attention by FlashInfer when installed, else by a Triton kernel, else portable PyTorch.

FlashInfer (``BatchPrefillWithPagedKVCacheWrapper``) reads our ND cache directly as its "NHD"
paged layout, takes any page size, handles prefill, chunked prefill, decode and mixed batches in
one call with the query aligned to the end of the context (its causal mask is bottom-right), and
plans once per step for all layers. flash-attn's paged KV would need a page size that is a
multiple of 256, which rules out the block sizes kvsim studies, so it is not used.
FlashInfer runs fp16/bf16; without it the Triton kernel (``triton_attention.py``) takes float
caches; int8 (C8) caches and anything neither takes fall back to the portable path. A step
captured in a CUDA graph (``realexec/graphs.py``) attends through the token-addressed path
(Triton, or its PyTorch reference), whose shapes do not change between replays.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvsim.realexec.backends.base import AttentionMetadata
from kvsim.realexec.backends.cache_ops import KVCaches, allocate_caches, swap_blocks
from kvsim.realexec.backends.errors import BackendUnavailable
from kvsim.realexec.backends.kv_quant import KVScales
from kvsim.realexec.backends.portable import TorchBackend
from kvsim.realexec.backends.token_attention import TokenMetadata, token_paged_attention
from kvsim.realexec.backends.triton_attention import supports as triton_supports
from kvsim.realexec.backends.triton_attention import token_paged_attention_triton

R = TypeVar("R")

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_SIZES = (64, 128, 256)
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k workspace


# Bundled profiles a CUDA calibration starts from, by a marker in the device's name.
# First match wins: "NVIDIA H100 PCIe" before the SXM part's "NVIDIA H100 80GB HBM3". A 40 GB A100 has no profile.
CUDA_PROFILES = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-sxm"))


class CudaStepGraph:
    """A ``realexec.graphs.StepGraph`` on a CUDA graph, in its executor's memory pool."""

    WARMUP_RUNS = 2  # on a side stream before capture, as PyTorch's capture recipe asks (lazy init, Triton JIT)

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class CudaBackend(TorchBackend):
    name = "cuda"
    supports_graphs = True
    process_group = "nccl"

    def __init__(self, device: str | None = None, paged_kernel: str = "auto") -> None:
        """``paged_kernel``: "auto" (FlashInfer if importable, else Triton), "flashinfer" (required), "triton" or "torch"."""
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                f"cuda backend unavailable: torch {torch.__version__} sees no CUDA device"
                + ("" if torch.version.cuda else " (this torch build has no CUDA support)")
            )
        if paged_kernel not in ("auto", "flashinfer", "triton", "torch"):
            raise ValueError(f"paged_kernel must be 'auto', 'flashinfer', 'triton' or 'torch', got {paged_kernel!r}")
        self.device = torch.device(device or "cuda")
        self._flashinfer = (
            _import_flashinfer(required=paged_kernel == "flashinfer") if paged_kernel in ("auto", "flashinfer") else None
        )
        self._triton = paged_kernel in ("auto", "triton")
        self.paged_kernel = "flashinfer" if self._flashinfer is not None else "triton" if self._triton else "torch"
        self._wrapper: Any = None
        self._planned_for: tuple[weakref.ref[AttentionMetadata], tuple] | None = None

    def machine_name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def new_graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_graph(self, pool: Any) -> CudaStepGraph:
        return CudaStepGraph(pool)

    def default_profile(self) -> str:
        name = self.machine_name()
        for marker, profile_name in CUDA_PROFILES:
            if marker in name:
                return profile_name
        raise ValueError(f"no bundled profile for CUDA device {name!r}: pass --base-device NAME or a .toml path")

    def allocate_host_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
        value_head_size: int | None = None,
    ) -> KVCaches:
        return allocate_caches(
            num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, "cpu", pin_memory=True,
            value_head_size=value_head_size,
        )

    def swap(self, src_caches: KVCaches, dst_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        swap_blocks(src_caches, dst_caches, pairs, non_blocking=True)

    def attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        if meta.captured:  # a graph's static metadata: only the token-addressed path keeps its shapes
            tokens = TokenMetadata.of_step(meta)
            if self._triton_takes(query, key_cache, kv_scales):
                return token_paged_attention_triton(query, key_cache, value_cache, tokens, scale)
            return token_paged_attention(query, key_cache, value_cache, tokens, scale, kv_scales)
        if self._flashinfer is None and self._triton_takes(query, key_cache, kv_scales):
            return token_paged_attention_triton(query, key_cache, value_cache, TokenMetadata.of_step(meta), scale)
        if (
            self._flashinfer is None
            or query.dtype not in FLASHINFER_DTYPES
            or key_cache.dtype != query.dtype
            or query.shape[-1] not in FLASHINFER_HEAD_SIZES
        ):
            return super().attention(query, key_cache, value_cache, meta, scale, kv_scales)
        self._plan_flashinfer(query, key_cache, meta, scale)
        return self._wrapper.run(query.contiguous(), (key_cache, value_cache))

    def _triton_takes(self, query: torch.Tensor, key_cache: torch.Tensor, kv_scales: KVScales | None) -> bool:
        return self._triton and kv_scales is None and triton_supports(query, key_cache)

    def _plan_flashinfer(
        self, query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> None:
        """Plan once per step: every layer of the step shares the plan (FlashInfer's intended use)."""
        problem = (query.shape[1], key_cache.shape[2], query.shape[2], query.dtype, scale)
        if self._planned_for is not None and self._planned_for[0]() is meta and self._planned_for[1] == problem:
            return
        if self._wrapper is None:
            workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            self._wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        block_size = meta.block_size
        seq_lens = meta.seq_lens.to(torch.int32)
        num_pages = (seq_lens + block_size - 1) // block_size
        used = torch.arange(meta.block_tables.shape[1], device=self.device)[None, :] < num_pages[:, None]
        self._wrapper.plan(
            meta.query_start_loc.to(torch.int32),
            torch.cat([num_pages.new_zeros(1), torch.cumsum(num_pages, 0, dtype=torch.int32)]),
            meta.block_tables[used].to(torch.int32),  # row-major: each sequence's pages in order
            seq_lens - (num_pages - 1) * block_size,
            query.shape[1],
            key_cache.shape[2],
            query.shape[2],
            block_size,
            causal=True,
            sm_scale=scale,
            q_data_type=query.dtype,
            kv_data_type=key_cache.dtype,
        )
        self._planned_for = (weakref.ref(meta), problem)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def make_current(self) -> None:
        torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_in_use(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def elapsed(self, fn: Callable[[], R]) -> tuple[R, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end) / 1e3


def _import_flashinfer(required: bool) -> Any:
    try:
        import flashinfer
    except ImportError as err:
        if required:
            raise BackendUnavailable(f"cuda backend: FlashInfer requested but not importable ({err})") from err
        return None
    return flashinfer
