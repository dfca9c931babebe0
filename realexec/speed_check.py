"""Is the machine as fast now as when its profile was measured? A few reference steps say.

A profile holds for the machine state it was measured in. On a shared host that state drifts:
on the 2-core development VM the same CPU step's median moved by up to 1.9x between processes
minutes apart (docs/benchmarks.md), and a cached profile then misses every step by that much,
whatever its model. ``kvsim validate`` therefore times three reference steps next to its real
run, primed and interleaved as the profiler times its cases, and reports how their measured
time compares with the profile's prediction: a ratio far from 1 means re-profile (``--reprofile``)
before reading the timing errors as the model's. The stale decision reads the reference farthest
from its prediction, not the median: each stands for a kind of step (the default workload is
mostly 1-sequence decodes), and on the development VM a median of 1.10 once hid the 1-sequence
decode at 1.32x (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.realexec.backends import KernelBackend
from kvsim.realexec.executor import Executor
from kvsim.realexec.profile_bench import OperatorBenches, measure
from kvsim.realexec.profile_shapes import StepShape, decode, footprint, prefill
from kvsim.sim.cost_model import CostModel

REFERENCE_SHAPES: tuple[tuple[str, StepShape], ...] = (
    ("decode 1 x 128", decode(1, 128)),
    ("decode 8 x 256", decode(8, 256)),
    ("prefill 256", prefill(256)),
)
REPEATS = 5


@dataclass(frozen=True)
class SpeedCheck:
    """Median measured and predicted seconds of each reference step."""

    labels: list[str]
    measured_s: list[float]
    predicted_s: list[float]

    @property
    def ratio(self) -> float:
        """Median of measured / predicted: 1.3 means the machine runs 30 % slower than its profile says."""
        return float(np.median(np.array(self.measured_s) / np.array(self.predicted_s)))

    @property
    def worst(self) -> tuple[str, float]:
        """The reference step farthest from its prediction (either way), and its measured / predicted."""
        ratios = np.array(self.measured_s) / np.array(self.predicted_s)
        i = int(np.argmax(np.abs(ratios - 1.0)))
        return self.labels[i], float(ratios[i])

    def to_dict(self) -> dict:
        label, ratio = self.worst
        return {"labels": self.labels, "measured_s": self.measured_s, "predicted_s": self.predicted_s, "ratio": self.ratio,
                "worst": {"label": label, "ratio": ratio}}


def speed_check(backend: KernelBackend, cost: CostModel, seed: int = 0) -> SpeedCheck:
    """Time the reference steps on ``backend`` as the profiler times whole steps (its clock), and predict them with ``cost``."""
    block_size = cost.block_size
    blocks = 2 * max(footprint(shape, block_size) for _, shape in REFERENCE_SHAPES)  # room for spread-out tables
    executor = Executor(cost.model, backend, num_blocks=blocks, block_size=block_size, seed=seed,
                        kv_dtype=cost.kv_dtype)
    rng = np.random.default_rng(seed)
    benches = OperatorBenches(executor, rng, seed)
    samples = [benches.step(shape) for _, shape in REFERENCE_SHAPES]
    measured = measure(samples, REPEATS, rng).median
    return SpeedCheck(
        labels=[label for label, _ in REFERENCE_SHAPES],
        measured_s=[float(m) for m in measured],
        predicted_s=[float(cost.predict(s.features)) for s in samples],
    )
