"""Is the machine as fast now as when its profile was measured? A few reference steps say.

A profile holds for the machine state it was measured in. On a shared host that state drifts:
on the 2-core development VM the same CPU step's median moved by up to 1.9x between processes
minutes apart (docs/benchmarks.md), and a cached profile then misses every step by that much,
whatever its model. ``kvsim validate`` therefore times three reference steps next to its real
run, primed and interleaved as the profiler times its cases, and reports how their measured
time compares with the profile's prediction: a ratio far from 1 means re-profile (``--reprofile``)
before reading the timing errors as the model's. Profiles from ``kvsim profile`` also record
what the reference steps took when the machine was profiled: measured now over then is the
machine's drift alone, and predicted over then the model's own miss on those steps, both
reported; the machine's move (``machine_ratio``) is what decides a re-profile and what
``kvsim validate``'s verdict weighs (realexec/repeatability.py).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvsim.realexec.backends import KernelBackend
from kvsim.realexec.executor import Executor
from kvsim.realexec.profile_bench import OperatorBenches, Sample, measure
from kvsim.realexec.profile_shapes import StepShape, decode, footprint, prefill
from kvsim.sim.perf.cost_model import CostModel, StepFeatures
from kvsim.sim.perf.model_spec import ModelSpec

REFERENCE_SHAPES: tuple[tuple[str, StepShape], ...] = (
    ("decode 1 x 128", decode(1, 128)),
    ("decode 8 x 256", decode(8, 256)),
    ("prefill 256", prefill(256)),
)
REFERENCE_LABELS = tuple(label for label, _ in REFERENCE_SHAPES)
REPEATS = 5
# Fresh executors a reading takes each step's median over. One executor's steps read apart from
# the next one's on the same machine (new weights and caches, laid out anew): on the 2-core VM the
# small model's readings scattered by up to 11-13 % with one and 6-9 % with three, and on an H200
# by 12-28 % with one (docs/benchmarks.md), as much as the 10 % move the verdict looks for.
REFERENCE_EXECUTORS = 3


@dataclass(frozen=True)
class SpeedCheck:
    """Median measured seconds of each reference step, beside its prediction and (if recorded) its time when profiled."""

    labels: list[str]
    measured_s: list[float]
    predicted_s: list[float]
    profiled_s: list[float] | None = None  # None: the profile did not record its reference steps
    # what the steps ran: ``against`` predicts them anew
    features: list[StepFeatures] = field(default_factory=list, compare=False, repr=False)

    @property
    def ratio(self) -> float:
        """Median of measured / predicted: 1.3 means the steps took 30 % longer than the profile predicts."""
        return median_ratio(self.measured_s, self.predicted_s)

    @property
    def machine_ratio(self) -> float:
        """Median of measured / their time when profiled: the machine's move alone (no model in it);
        over the prediction (``ratio``) where the profile recorded no reference steps."""
        if not self.profiled_s:
            return self.ratio
        return median_ratio(self.measured_s, self.profiled_s)

    def against(self, cost: CostModel) -> SpeedCheck:
        """The same measurements against ``cost``'s prediction and the times its profile recorded: one check
        read against another profile (a biased copy of the one it was timed for) without timing it again."""
        recorded = cost.device.reference_steps_s
        return replace(
            self,
            predicted_s=[float(cost.predict(f)) for f in self.features],
            profiled_s=[recorded[label] for label in self.labels] if all(label in recorded for label in self.labels) else None,
        )

    def to_dict(self) -> dict:
        return {"labels": self.labels, "measured_s": self.measured_s, "predicted_s": self.predicted_s,
                "profiled_s": self.profiled_s, "ratio": self.ratio, "machine_ratio": self.machine_ratio}


def reference_blocks(block_size: int) -> int:
    """KV blocks the reference steps need, with room for spread-out tables."""
    return 2 * max(footprint(shape, block_size) for _, shape in REFERENCE_SHAPES)


def reference_times(
    backend: KernelBackend, spec: ModelSpec, block_size: int, kv_dtype: str, seed: int = 0,
    executors: int = REFERENCE_EXECUTORS, repeats: int = REPEATS,
) -> tuple[list[float], list[StepFeatures]]:
    """The reference steps timed on ``backend`` as the profiler times whole steps (its clock): each
    one's median seconds over ``executors`` fresh executors, built one after another (one in memory
    at a time, as an 8B model's weights ask), each timed over ``repeats`` rounds; and the steps' features."""
    medians, features = [], []
    for i in range(executors):
        executor = Executor(spec, backend, num_blocks=reference_blocks(block_size), block_size=block_size, seed=seed + i,
                            kv_dtype=kv_dtype)
        measured, samples = interleaved_reference_times([executor], seed + i, repeats)[0]
        medians.append(measured)
        features = [s.features for s in samples]
        del executor, samples
        gc.collect()  # the executor's weights freed before the next one's are made
    return [float(m) for m in np.median(np.array(medians), axis=0)], features


def interleaved_reference_times(executors: Sequence[Executor], seed: int = 0, repeats: int = REPEATS,
                                passes: int = 1) -> list[tuple[list[float], list[Sample]]]:
    """Each executor's reference steps (its median seconds over ``repeats`` rounds, its samples), timed in interleaved
    rounds: every executor's steps meet the machine's same moments, so their ratios hold where the machine drifts.
    A run of a step is the median of ``passes`` forward passes (``OperatorBenches.step``). Each executor needs
    ``reference_blocks`` blocks."""
    rng = np.random.default_rng(seed)
    benches = [OperatorBenches(executor, rng, seed) for executor in executors]
    samples = [[own.step(shape, passes) for _, shape in REFERENCE_SHAPES] for own in benches]
    medians = measure([s for own in samples for s in own], repeats, rng).median
    n = len(REFERENCE_SHAPES)
    return [([float(m) for m in medians[i * n : (i + 1) * n]], own) for i, own in enumerate(samples)]


def reference_steps(backend: KernelBackend, spec: ModelSpec, block_size: int, kv_dtype: str,
                    seed: int = 0) -> tuple[dict[str, float], list[StepFeatures]]:
    """Label -> median seconds of each reference step now (what a profile records beside its fit), and their features."""
    measured, features = reference_times(backend, spec, block_size, kv_dtype, seed)
    return dict(zip(REFERENCE_LABELS, measured)), features


def median_ratio(seconds: Sequence[float], against: Sequence[float]) -> float:
    """Median over the reference steps of ``seconds / against`` (now over predicted, now over when
    profiled, or, in ``kvsim profile``, when profiled over the fit's prediction)."""
    return float(np.median(np.asarray(seconds) / np.asarray(against)))


def speed_check(backend: KernelBackend, cost: CostModel, seed: int = 0) -> SpeedCheck:
    """Time the reference steps on ``backend``, against ``cost``'s prediction and the times its profile recorded."""
    measured, features = reference_times(backend, cost.model, cost.block_size, cost.kv_dtype, seed)
    return SpeedCheck(labels=list(REFERENCE_LABELS), measured_s=measured, predicted_s=[], features=features).against(cost)
