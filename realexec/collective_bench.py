"""The collectives a tensor-parallel group runs, timed on this host and fitted to the simulator's link model.

Every rank runs the same sequence (rank 0 times it): for each size, a barrier and then one
all-reduce or all-gather, ``repeats`` times, the median kept. The sizes are a step's: the hidden
states of 1 to 512 tokens (the all-reduces) and the logits of 1 to 32 sampled rows (the all-gather).

The fit gives the ``[topology]`` a calibrated profile carries, in sim/parallel/collectives.py's
terms for a group of ``n`` ranks through one switch (loopback TCP is one: every byte a rank sends
crosses its one socket path): all-gather ``a + (n-1)/n S / b``, all-reduce ``2 a + (n-1)/n S / b
(1 + 1/r)``. Three unknowns, ``a``, ``1/b`` and ``1/(b r)``, solved by least squares on relative
error (a small message's microseconds weigh as much as a large one's milliseconds).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from kvsim.realexec.tensor_parallel import TensorParallelGroup
from kvsim.sim.parallel.collectives import all_gather_s, all_reduce_s, make_group
from kvsim.sim.perf.model_spec import DTYPE_BYTES, ModelSpec
from kvsim.sim.perf.topology import Topology

TOKEN_COUNTS = (1, 4, 16, 64, 256, 512)  # hidden states of this many tokens: the all-reduces' sizes
SAMPLED_ROWS = (1, 4, 32)  # logits of this many sampled rows: the all-gather's sizes
KINDS = ("all_reduce", "all_gather")


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


def time_collectives(group: TensorParallelGroup, sizes: list[tuple[str, int]], repeats: int) -> list[CollectiveTiming]:
    """Each (kind, bytes) run ``repeats`` times after a barrier; the median seconds (every rank must call this)."""
    out = []
    for kind, size in sizes:
        values = size // 4 // (group.size if kind == "all_gather" else 1)
        x = torch.ones(max(1, values), dtype=torch.float32)
        runs = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if kind == "all_reduce":
                group.all_reduce(x)
            else:
                group.all_gather_last(x)
            runs.append(time.perf_counter() - start)
        out.append(CollectiveTiming(kind, size, statistics.median(runs)))
    return out


def fit_topology(timings: list[CollectiveTiming], ranks: int, base: Topology) -> Topology:
    """``base`` with the loopback group's latency, bandwidth and reduction rate fitted on ``timings`` (module docstring)."""
    share = (ranks - 1) / ranks
    rows, targets = [], []
    for t in timings:
        s = share * t.size_bytes
        rows.append([2.0, s, s] if t.kind == "all_reduce" else [1.0, s, 0.0])
        targets.append(t.median_s)
    a_matrix, y = np.array(rows), np.array(targets)
    weights = 1.0 / y
    solution, *_ = np.linalg.lstsq(a_matrix * weights[:, None], y * weights, rcond=None)
    latency = max(float(solution[0]), 0.0)
    per_byte = max(float(solution[1]), 1e-15)
    reduce_per_byte = max(float(solution[2]), per_byte)  # a reduction is not faster than moving its bytes
    return replace(base, devices_per_node=max(base.devices_per_node, ranks), intra_fabric="switch",
                   intra_bandwidth=1.0 / per_byte, intra_latency_s=latency, bandwidth_efficiency=1.0,
                   reduce_efficiency=per_byte / reduce_per_byte)


def predicted_s(topology: Topology, ranks: int, timing: CollectiveTiming) -> float:
    """What the simulator prices this collective at under ``topology``."""
    group = make_group(topology, ranks)
    return (all_reduce_s if timing.kind == "all_reduce" else all_gather_s)(group, timing.size_bytes)


COLLECTIVE_REPEATS = 31


def measure_twice(timer, spec: ModelSpec, ranks: int, repeats: int = COLLECTIVE_REPEATS) -> dict[str, list[dict]]:
    """A fit set and, right after it, a check set of the group's step-sized collectives (``timer``:
    ``TensorParallelExecutor.time_collectives``), as JSON-ready rows: the fit never sees the rows it is checked on."""
    sizes = step_sizes(spec, ranks)
    return {name: [vars(t) for t in timer(sizes, repeats)] for name in ("fit", "check")}


def fitted_and_checked(measured: dict[str, list[dict]], ranks: int, base: Topology) -> tuple[Topology, list[dict]]:
    """The topology fitted on ``measured["fit"]``, and its prediction of every ``check`` row beside the measurement."""
    topology = fit_topology([CollectiveTiming(**row) for row in measured["fit"]], ranks, base)
    rows = []
    for row in measured["check"]:
        timing = CollectiveTiming(**row)
        predicted = predicted_s(topology, ranks, timing)
        rows.append({**row, "predicted_s": predicted, "error": predicted / timing.median_s - 1.0})
    return topology, rows
