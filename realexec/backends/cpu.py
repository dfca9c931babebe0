"""The cpu backend: portable paged kernels on host memory, what CI and the tiny-model demo run.

``memory_in_use`` reports the bytes of the KV caches this backend allocated and that are
still alive (tracked by weak reference), not the process's RSS: the device-memory figure the
simulator is validated against is the KV pool, and on a CPU there is no allocator to ask.
The swap pool is host memory on every device, so it is not counted here either.

Its device clock is CPU time, not the wall clock: as a GPU's or an NPU's step time comes from
device events, time this process spent descheduled (other tenants, other threads, a
hypervisor's steal) is not time the "device" worked. One decode step repeated under a load of
about 3 on 2 cores spread 33.7 % on the wall clock and 9.1 % in thread CPU time (issue 13).
With one intra-op thread (``KVSIM_CPU_THREADS``, default 1) every kernel runs on the calling
thread, so ``time.thread_time()`` sees all of it; with more, the clock is the process's CPU
time, the work of all its threads. One thread also because on a 2-core VM two made step
times 3-25x noisier (docs/benchmarks.md). Profiles are only comparable at the same thread
count, which is part of the machine fingerprint.

CPU time still varies run to run (caches and memory bandwidth shared with other tenants: 8-30 %
for one run of a few milliseconds), so the executor times each step's forward pass eleven times
and keeps the median (``KVSIM_CPU_TIMING_REPEATS``; ``Executor`` says why that is sound), as
the profiler takes the median of its rounds; the repeat count is part of the fingerprint too.
Eleven, not five: on a VM instance whose small decode steps drifted within minutes, `kvsim
validate` passed 8 of 10 runs with eleven and 2 of 10 with five, the two taken in alternation
(docs/benchmarks.md); the real run's steps then take about twice as long to time.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kvsim.realexec.backends.cache_ops import KVCaches, allocate_caches, swap_blocks
from kvsim.realexec.backends.portable import TorchBackend

R = TypeVar("R")
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit hosts: blocks below this come from the heap


def _positive_env(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return int(value)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory in the process instead of handing it back to the kernel.

    A step allocates its activations afresh; by default glibc serves large blocks with ``mmap``
    and unmaps them on free, so every step faults in new zeroed pages, on CPU time that depends
    on the kernel's memory pressure. A 200-token prefill of the tiny model took 22 page faults
    a step by default and 1.7 with this; its median CPU time fell about 5 % and its
    run-to-run spread roughly halved (docs/benchmarks.md). Returns False where there is no glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD_MAX) and libc.mallopt(m_trim_threshold, 2**31 - 1))


def cpu_threads() -> int:
    """Intra-op threads the cpu backend times with (``KVSIM_CPU_THREADS``, default 1)."""
    return _positive_env("KVSIM_CPU_THREADS", 1)


def cpu_timing_repeats() -> int:
    """Forward-pass runs timed per step, median kept (``KVSIM_CPU_TIMING_REPEATS``, default 11)."""
    return _positive_env("KVSIM_CPU_TIMING_REPEATS", 11)


class CpuBackend(TorchBackend):
    name = "cpu"
    rerun_advice = "rerun it, on a quieter machine (stop other work on it) or on an accelerator (--backend cuda)"
    # CPU SDPA has vectorised fp32 and bf16 kernels but no fast fp16 path.
    compute_dtypes = {torch.float16: torch.float32}

    def __init__(self, device: str | None = None, wall_clock: bool = False) -> None:
        """``wall_clock``: time on ``time.perf_counter``, for a tensor-parallel rank (realexec/tp_executor.py),
        whose waits on the other ranks inside a collective are part of a step and take no CPU time."""
        if device not in (None, "cpu"):
            raise ValueError(f"the cpu backend runs on 'cpu', not {device!r}")
        self.device = torch.device("cpu")
        self.threads = cpu_threads()
        self.timing_repeats = cpu_timing_repeats()
        self.keeps_freed_memory = keep_freed_memory()
        torch.set_num_threads(self.threads)
        if wall_clock:
            self._cpu_time, self.clock = time.perf_counter, "wall clock (tensor-parallel ranks)"
        elif self.threads == 1:
            self._cpu_time, self.clock = time.thread_time, "thread CPU time"
        else:
            self._cpu_time, self.clock = time.process_time, f"process CPU time ({self.threads} threads)"
        self._caches: list[weakref.ref[torch.Tensor]] = []

    def host_time(self) -> float:
        return self._cpu_time()

    def default_profile(self) -> str:
        return "cpu"

    def machine_name(self) -> str:
        return f"{_processor_name()} ({os.cpu_count()} cpus)"

    def fingerprint_parts(self) -> list[str]:
        return [self.name, platform.machine(), self.machine_name(), torch.__version__, f"{self.threads} torch threads",
                f"median of {self.timing_repeats} timed runs per step", *self.mode_parts()]

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
        value_head_size: int | None = None,
    ) -> KVCaches:
        caches = super().allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, value_head_size)
        self._caches = [ref for ref in self._caches if ref() is not None]
        self._caches += [weakref.ref(t) for pair in caches for t in pair]
        return caches

    def allocate_host_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
        value_head_size: int | None = None,
    ) -> KVCaches:
        # Pinning needs an accelerator's allocator; there is none on the CPU path.
        return allocate_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, "cpu", value_head_size=value_head_size)

    def swap(self, src_caches: KVCaches, dst_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        swap_blocks(src_caches, dst_caches, pairs, non_blocking=False)

    def synchronize(self) -> None:
        """Nothing is queued: CPU kernels return when done."""

    def memory_in_use(self) -> int:
        return sum(t.nbytes for t in (ref() for ref in self._caches) if t is not None)

    def elapsed(self, fn: Callable[[], R]) -> tuple[R, float]:
        start = self._cpu_time()
        result = fn()
        return result, self._cpu_time() - start


def _processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
