"""A CUDA-graph stand-in for the CPU: the cpu backend with graphs that rerun the captured function.

A CPU has no CUDA graphs; this drives the executor's graph path (static buffers refilled per step,
padding rows, capture sizes) where the tests run. Shared by tests/test_graphs.py and
tests/test_end_to_end.py.
"""

from __future__ import annotations

from kvsim.realexec.backends.cpu import CpuBackend
from kvsim.sim.perf.device import load_device

VLLM_SIZES = load_device("h200").engine.capture_sizes


class RerunGraph:
    """A StepGraph stand-in: capture runs the function once (the warm-up) and replay reruns it."""

    def __init__(self, pool: object) -> None:
        self.pool = pool  # the memory pool a CUDA graph would capture into
        self.fn = None
        self.replays = 0

    def capture(self, fn) -> None:
        fn()
        self.fn = fn

    def replay(self) -> None:
        self.replays += 1
        self.fn()


class GraphingCpuBackend(CpuBackend):
    """The cpu backend with stand-in graphs at vLLM's capture sizes."""

    supports_graphs = True

    def __init__(self) -> None:
        super().__init__()
        self.capture_sizes = VLLM_SIZES
        self.graphs: list[RerunGraph] = []
        self.pools: list[object] = []

    def new_graph_pool(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def new_graph(self, pool: object) -> RerunGraph:
        self.graphs.append(RerunGraph(pool))
        return self.graphs[-1]
