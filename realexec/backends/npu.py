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

Block size: FIA with page attention and more than one query token per sequence needs a multiple
of 128 up to 512, so caches are refused at allocation for any other size (vllm-ascend's
``get_supported_kernel_block_sizes()`` is ``[128]`` for the same reason). FIA takes fp16/bf16
queries only, so fp32 caches are refused too.

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

Tests pass a stand-in module (``tests/torch_npu_standin.py``) as ``torch_npu_module`` with ``device="cpu"``.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any, TypeVar

import torch

from kvsim.realexec.backends.base import AttentionMetadata, KernelBackend
from kvsim.realexec.backends.cache_ops import KVCaches, allocate_caches, copy_blocks, swap_blocks
from kvsim.realexec.backends.errors import BackendUnavailable

R = TypeVar("R")

NPU_DTYPES = (torch.float16, torch.bfloat16)  # FIA: "query ... 数据类型支持float16、bfloat16、int8"
FIA_BLOCK_SIZES = (128, 256, 384, 512)  # FIA, Q_S > 1 with page attention: multiple of 128 in [128, 512]
PAGED_ATTENTION_MAX_BLOCK = 128  # ATB PagedAttention: "block_size <= 128"
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

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> KVCaches:
        if dtype not in NPU_DTYPES:
            raise ValueError(
                f"npu backend: KV dtype {dtype} unsupported; FIA takes float16/bfloat16 queries and caches"
            )
        if block_size not in FIA_BLOCK_SIZES:
            raise ValueError(
                f"npu backend: block_size={block_size} unsupported; FIA prefill over a paged cache needs a multiple of 128 "
                "in [128, 512] (torch_npu npu_fused_infer_attention_score: 'block_size最小为128, 最大为512, 且要求是128的倍数')"
            )
        return allocate_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, self.device)

    def allocate_host_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> KVCaches:
        pin = self.device.type != "cpu"  # pinned host memory needs a device to pin for
        return allocate_caches(
            num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, "cpu", pin_memory=pin
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
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
    ) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        num_heads = query.shape[1]
        query = query.contiguous()
        if meta.is_decode_only and block_size <= PAGED_ATTENTION_MAX_BLOCK:
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
