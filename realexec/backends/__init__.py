"""Kernel backends (npu, cuda, cpu) behind one interface, chosen by name.

Importing this package sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (unless the user set it) before
torch is first imported; ``realexec.backends.npu`` explains why that is both necessary and safe.
It only helps if it runs before the process's first ``import torch``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from kvsim.realexec.backends.base import AttentionMetadata, KernelBackend  # noqa: E402
from kvsim.realexec.backends.errors import BackendUnavailable  # noqa: E402

BACKEND_NAMES = ("cpu", "cuda", "npu")

__all__ = ["AttentionMetadata", "BACKEND_NAMES", "BackendUnavailable", "KernelBackend", "get_backend"]


def get_backend(name: str, device: str | None = None) -> KernelBackend:
    """The named backend on ``device`` (its default device when None).

    Raises ``BackendUnavailable`` with a one-line reason when the backend cannot run here.
    """
    if name == "cpu":
        from kvsim.realexec.backends.cpu import CpuBackend

        if device not in (None, "cpu"):
            raise ValueError(f"the cpu backend runs on 'cpu', not {device!r}")
        return CpuBackend()
    if name == "cuda":
        from kvsim.realexec.backends.cuda import CudaBackend

        return CudaBackend(device)
    if name == "npu":
        from kvsim.realexec.backends.npu import NpuBackend

        return NpuBackend(device)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
