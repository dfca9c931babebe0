"""The collectives a tensor-parallel group runs, timed on this host and fitted to the simulator's link model.

Every rank runs the same sequence (rank 0 times it): ``repeats`` rounds, each visiting every size in
turn with a stretch of compute (a GEMM of about a millisecond, as a layer's) and then one all-reduce
or all-gather, twice: the second is timed, from the compute's end to the collective's, and a size's
time is its median over the rounds. Twice, because a step's all-reduces are all one size (the
hidden states of its tokens), each after the last: timed right after a larger one, a collective
carries the skew that one left between the ranks (on the 2-core VM the all-reduce that followed a
1.5 MB one took 12-15 us more, whatever its size, and the line below missed the 3 KB one by 10-26 %
in ten sets; timed after its own size, no all-reduce missed by more than 13 %). Rounds, not a
size's repeats back to back, so a spell of the machine's falls on every size alike (and on the fit
and check sets alike, which are timed in the same rounds): two sets timed one after the other
disagreed by up to 2.6x at a size (a 3 KB all-reduce, TP2 on the 2-core VM), more than any link
model can answer for. Timed as a step meets them (the wait for a peer still computing included),
not after a barrier: on the 2-core development VM a 3 KB gloo all-reduce took 0.7 ms after a
barrier and 1.2 ms after compute, the figure the TP2 steps showed (each rank's main thread and
gloo's threads then contend for the cores). The sizes are a step's: the hidden states of 1 to 512
tokens (the all-reduces) and the logits of 1 to 32 sampled rows (the all-gather).

The fit gives the ``[topology]`` a calibrated profile carries, in sim/parallel/collectives.py's
terms for a group of ``n`` ranks through one switch (every byte a rank sends takes one path: its
socket, or its slot of the shared buffer): an all-reduce ``2 a + 2 (n-1)/n S / b`` (``r`` = 1: the
adds are in ``b``), ``a`` and ``b`` by least squares on relative error (a small message's
microseconds weigh as much as a large one's milliseconds), on the all-reduces alone: a step runs
one per layer and MLP and one after the embedding, and the logits' all-gather once. The
all-gather is then priced ``a + (n-1)/n S / b``; through shared memory it is one exchange, as an
all-reduce is, so its fixed cost comes out about half what it measures (tens of microseconds a step).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from kvsim.realexec.backends.base import KernelBackend
from kvsim.realexec.tensor_parallel import TensorParallelGroup
from kvsim.sim.parallel.collectives import all_gather_s, all_reduce_s, make_group
from kvsim.sim.perf.model_spec import DTYPE_BYTES, ModelSpec
from kvsim.sim.perf.topology import Topology

TOKEN_COUNTS = (1, 4, 16, 64, 256, 512)  # hidden states of this many tokens: the all-reduces' sizes
SAMPLED_ROWS = (1, 4, 32)  # logits of this many sampled rows: the all-gather's sizes
COLLECTIVE_REPEATS = 101  # runs a size's median is taken over (31 left a size's median moving 2x between sets)


@dataclass(frozen=True)
class CollectiveTiming:
    kind: str  # all_reduce | all_gather
    size_bytes: int  # the buffer every rank ends with (the all-gather's whole output)
    median_s: float


def step_sizes(spec: ModelSpec, tp: int) -> list[tuple[str, int]]:
    """(kind, bytes) a TP step of ``spec`` runs: hidden-state all-reduces and logit all-gathers."""
    hidden = spec.hidden_size * DTYPE_BYTES[spec.activation_dtype]
    vocab = -(-spec.vocab_size // tp) * tp  # the ranks' padded slices
    return ([("all_reduce", n * hidden) for n in TOKEN_COUNTS]
            + [("all_gather", n * vocab * 4) for n in SAMPLED_ROWS])


def time_collectives(group: TensorParallelGroup, backend: KernelBackend, sizes: list[tuple[str, int]],
                     repeats: int) -> list[CollectiveTiming]:
    """Each (kind, bytes) after a stretch of compute, twice a round (the second timed: it follows its own size, as
    in a step) for ``repeats`` rounds; the median seconds from the compute's end to the collective's (module
    docstring), on ``backend``'s device and clock (a tensor-parallel rank's: the wall clock on the cpu backend,
    device events on an accelerator). Every rank must call this."""
    device = backend.device
    rows, weight = torch.ones(16, 768, device=device), torch.ones(768, 1024, device=device)
    inputs = [(group.all_reduce if kind == "all_reduce" else group.all_gather_last,
               torch.ones(max(1, size // 4 // (group.size if kind == "all_gather" else 1)), dtype=torch.float32,
                          device=device))
              for kind, size in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    dist.barrier()
    for _ in range(repeats):
        for (collective, x), own in zip(inputs, times):
            rows @ weight
            collective(x)
            rows @ weight
            own.append(backend.elapsed(lambda: collective(x))[1])  # noqa: B023 (called at once)
    return [CollectiveTiming(kind, size, statistics.median(own)) for (kind, size), own in zip(sizes, times)]


def fit_topology(timings: list[CollectiveTiming], ranks: int, base: Topology) -> Topology:
    """``base`` with the group's latency and bandwidth fitted on the all-reduces of ``timings`` (module docstring)."""
    reduces = [t for t in timings if t.kind == "all_reduce"]
    if len(reduces) < 2:
        raise ValueError(f"fitting a group's links needs all-reduces of at least 2 sizes, got {len(reduces)}")
    share = (ranks - 1) / ranks
    latency, per_byte = fit_latency_per_byte(np.array([[2.0, 2.0 * share * t.size_bytes] for t in reduces]),
                                             np.array([t.median_s for t in reduces]))
    return replace(base, devices_per_node=max(base.devices_per_node, ranks), intra_fabric="switch",
                   intra_bandwidth=1.0 / per_byte, intra_latency_s=latency, bandwidth_efficiency=1.0,
                   reduce_efficiency=1.0)


def fit_latency_per_byte(terms: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(latency, seconds a byte) such that ``terms @ (latency, per_byte)`` fits ``seconds`` (a row a
    measurement: how many latencies and bytes it pays), by least squares on relative error (a small
    message's microseconds weigh as much as a large one's milliseconds); latency at least 0, a byte
    above 0."""
    solution, *_ = np.linalg.lstsq(terms / seconds[:, None], np.ones_like(seconds), rcond=None)
    return max(float(solution[0]), 0.0), max(float(solution[1]), 1e-15)


def predicted_s(topology: Topology, ranks: int, timing: CollectiveTiming) -> float:
    """What the simulator prices this collective at under ``topology``."""
    group = make_group(topology, ranks)
    return (all_reduce_s if timing.kind == "all_reduce" else all_gather_s)(group, timing.size_bytes)


def measure_twice(timer, spec: ModelSpec, ranks: int, repeats: int = COLLECTIVE_REPEATS) -> dict[str, list[dict]]:
    """A fit set and a check set of the group's step-sized collectives (``timer``:
    ``TensorParallelExecutor.time_collectives``), timed in the same rounds, as JSON-ready rows: the fit never
    sees the rows it is checked on, and both meet the machine's same moments."""
    sizes = step_sizes(spec, ranks)
    both = timer(sizes + sizes, repeats)
    return {"fit": [vars(t) for t in both[: len(sizes)]], "check": [vars(t) for t in both[len(sizes) :]]}


def fitted_and_checked(measured: dict[str, list[dict]], ranks: int, base: Topology) -> tuple[Topology, list[dict]]:
    """The topology fitted on ``measured["fit"]``, and its prediction of every ``check`` row beside the measurement."""
    topology = fit_topology([CollectiveTiming(**row) for row in measured["fit"]], ranks, base)
    rows = []
    for row in measured["check"]:
        timing = CollectiveTiming(**row)
        predicted = predicted_s(topology, ranks, timing)
        rows.append({**row, "predicted_s": predicted, "error": predicted / timing.median_s - 1.0})
    return topology, rows
