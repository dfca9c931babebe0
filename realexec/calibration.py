"""Which calibrated cost-model profile fits this machine, and making one when none does.

A profile measured on one machine says little about another, so profiles are cached per
machine fingerprint (processor, core count, torch version and threads, backend device name,
profiler version)
under ``$KVSIM_CACHE`` (default ``~/.cache/kvsim/profiles``). ``kvsim validate`` uses the
cached one or profiles on the spot (``kvsim profile --quick``) and caches the result.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Callable

import torch

from kvsim.realexec.backends.cpu import cpu_threads


# Part of the fingerprint: bump it when how ``kvsim profile`` measures changes, so profiles cached
# by an older profiler are not reused (2: every timed run primed by a run of the same case).
PROFILER_VERSION = 2


def cache_dir() -> Path:
    return Path(os.environ.get("KVSIM_CACHE", Path.home() / ".cache" / "kvsim")) / "profiles"


def _processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint(backend: str) -> str:
    threads = cpu_threads() if backend == "cpu" else torch.get_num_threads()
    parts = [backend, platform.machine(), _processor_name(), str(os.cpu_count()), torch.__version__, str(threads),
             f"profiler {PROFILER_VERSION}"]
    if backend == "cuda" and torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def calibrated_profile(backend: str, model: str, *, refresh: bool = False, echo: Callable[[str], None] | None = None) -> Path:
    """Path of this machine's calibrated profile for (backend, model), profiling now if there is none."""
    from kvsim.realexec.profiler import run_profile

    path = cache_dir() / f"{backend}-{Path(model).stem}-{machine_fingerprint(backend)}.toml"
    if path.exists() and not refresh:
        if echo:
            echo(f"using the calibrated profile {path}")
        return path
    if echo:
        echo(f"no calibrated {backend} profile for this machine: profiling now (kvsim profile --quick) ...")
    path.parent.mkdir(parents=True, exist_ok=True)
    run_profile(backend, model, path, quick=True, echo=echo)
    return path
