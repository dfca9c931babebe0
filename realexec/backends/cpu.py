"""The cpu backend: portable paged kernels on host memory, what CI and the tiny-model demo run.

``memory_in_use`` reports the bytes of the KV caches this backend allocated and that are
still alive (tracked by weak reference), not the process's RSS: the device-memory figure the
simulator is validated against is the KV pool, and on a CPU there is no allocator to ask.
The swap pool is host memory on every device, so it is not counted here either.

Timing runs on one intra-op thread unless ``KVSIM_CPU_THREADS`` says otherwise: on a 2-core
VM two threads made step times 3-25x noisier, and with one thread ``kvsim validate``'s TTFT
and TPOT p50 errors fell from 102 % / 88 % to 7 % / 6 % (docs/benchmarks.md). Profiles are
only comparable at the same thread count, which is part of the machine fingerprint.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from kvsim.realexec.backends.cache_ops import KVCaches, allocate_caches, swap_blocks
from kvsim.realexec.backends.portable import TorchBackend

R = TypeVar("R")


def cpu_threads() -> int:
    """Intra-op threads the cpu backend times with (``KVSIM_CPU_THREADS``, default 1)."""
    value = os.environ.get("KVSIM_CPU_THREADS", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"KVSIM_CPU_THREADS must be a positive integer, not {value!r}")
    return int(value)


class CpuBackend(TorchBackend):
    name = "cpu"
    # CPU SDPA has vectorised fp32 and bf16 kernels but no fast fp16 path.
    compute_dtypes = {torch.float16: torch.float32}

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        torch.set_num_threads(cpu_threads())
        self._caches: list[weakref.ref[torch.Tensor]] = []

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> KVCaches:
        caches = super().allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype)
        self._caches = [ref for ref in self._caches if ref() is not None]
        self._caches += [weakref.ref(t) for pair in caches for t in pair]
        return caches

    def allocate_host_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> KVCaches:
        # Pinning needs an accelerator's allocator; there is none on the CPU path.
        return allocate_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, "cpu")

    def swap(self, src_caches: KVCaches, dst_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        swap_blocks(src_caches, dst_caches, pairs, non_blocking=False)

    def synchronize(self) -> None:
        """Nothing is queued: CPU kernels return when done."""

    def memory_in_use(self) -> int:
        return sum(t.nbytes for t in (ref() for ref in self._caches) if t is not None)

    def elapsed(self, fn: Callable[[], R]) -> tuple[R, float]:
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start
