"""Kernel backends (npu, cuda, cpu) behind one interface, chosen by name.

Importing this package sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (unless the user set it) before
torch is first imported; ``realexec.backends.npu`` explains why that is both necessary and safe.
It only helps if it runs before the process's first ``import torch``.
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from kvsim.realexec.backends.base import AttentionMetadata, KernelBackend  # noqa: E402
from kvsim.realexec.backends.errors import BackendUnavailable  # noqa: E402

# The registry: name -> "module:Class", imported when asked for, so listing the names imports no backend.
BACKENDS: dict[str, str] = {
    "cpu": "kvsim.realexec.backends.cpu:CpuBackend",
    "cuda": "kvsim.realexec.backends.cuda:CudaBackend",
    "npu": "kvsim.realexec.backends.npu:NpuBackend",
}
BACKEND_NAMES = tuple(BACKENDS)

__all__ = ["AttentionMetadata", "BACKENDS", "BACKEND_NAMES", "BackendUnavailable", "KernelBackend", "backend_class", "get_backend"]


def backend_class(name: str) -> type[KernelBackend]:
    """The backend class registered as ``name``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, device: str | None = None, enforce_eager: bool = False) -> KernelBackend:
    """The named backend on ``device`` (its default device when None), running steps as graphs where it can.

    A backend that ``supports_graphs`` replays steps at the capture sizes of its bundled profile's
    ``[engine]`` (vLLM's, for the GPUs), the same list the simulator pads graph steps to, unless
    ``enforce_eager`` (vLLM's ``--enforce-eager``). Raises ``BackendUnavailable`` with a one-line
    reason when the backend cannot run here.
    """
    backend = backend_class(name)(device)
    if backend.supports_graphs and not enforce_eager:
        from kvsim.sim.perf.device import load_device

        profile = load_device(backend.default_profile())
        if profile.captures_graphs:
            backend.capture_sizes = profile.engine.capture_sizes
    return backend
