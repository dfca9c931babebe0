"""Is the machine as fast now as when its profile was measured? A few reference steps say.

A profile holds for the machine state it was measured in. On a shared host that state drifts:
on the 2-core development VM the same CPU step's median moved by up to 1.9x between processes
minutes apart (docs/benchmarks.md), and a cached profile then misses every step by that much,
whatever its model. ``kvsim validate`` therefore times three reference steps next to its real
run, primed and interleaved as the profiler times its cases, and reports how their measured
time compares with the profile's prediction: a ratio far from 1 means re-profile (``--reprofile``)
before reading the timing errors as the model's. During the real run, ``ProbedTimer`` times the
first of them every ``PROBE_EVERY`` steps, so the report shows whether the machine changed speed
while the run was being measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies.plan import StepPlan
from kvsim.policies.request import Request
from kvsim.realexec.backends import KernelBackend
from kvsim.realexec.executor import Executor
from kvsim.realexec.profile_bench import OperatorBenches, measure
from kvsim.realexec.profile_shapes import StepShape, decode, footprint, prefill
from kvsim.sim.cost_model import CostModel
from kvsim.sim.step_timer import StepTiming

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

    def to_dict(self) -> dict:
        return {"labels": self.labels, "measured_s": self.measured_s, "predicted_s": self.predicted_s, "ratio": self.ratio}


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


PROBE_SHAPE = REFERENCE_SHAPES[0]  # the batch-1 decode step, what most of a validate run's steps are
PROBE_EVERY = 50  # steps of the real run between probes
PROBE_RUNS = 3  # timed runs per probe (each primed), median kept


@dataclass
class SpeedProbes:
    """The reference step timed during a real run: how fast the machine ran at each point of it.

    A diagnostic beside the checks, never part of a step's time: on a shared host the machine's
    speed drifts by tens of per cent for seconds at a time (docs/benchmarks.md), and no profile
    taken before the run can predict that. ``ratios[i]`` is measured / predicted after step
    ``steps[i]``; 1.2 means the machine ran 20 % slower than its profile there.
    """

    steps: list[int]
    ratios: list[float]

    def to_dict(self) -> dict:
        return {"label": PROBE_SHAPE[0], "every_steps": PROBE_EVERY, "steps": self.steps, "ratios": self.ratios}


class ProbedTimer:
    """A real step timer that times the reference step every ``PROBE_EVERY`` steps, outside any step's time."""

    def __init__(self, timer, backend: KernelBackend, cost: CostModel, seed: int = 0) -> None:
        self.timer = timer
        self.probes = SpeedProbes([], [])
        block_size = cost.block_size
        executor = Executor(cost.model, backend, num_blocks=2 * footprint(PROBE_SHAPE[1], block_size), block_size=block_size,
                            seed=seed, kv_dtype=cost.kv_dtype, timing_repeats=1)
        sample = OperatorBenches(executor, np.random.default_rng(seed), seed).step(PROBE_SHAPE[1])
        self._case = sample.case
        self._predicted = float(cost.predict(sample.features))
        self._steps = 0

    def add_request(self, request: Request) -> None:
        self.timer.add_request(request)

    def step(self, plan: StepPlan) -> StepTiming:
        timing = self.timer.step(plan)
        self._steps += 1
        if self._steps % PROBE_EVERY == 0:
            run = self._case()
            times = []
            for _ in range(PROBE_RUNS):
                run()
                times.append(run())
            self.probes.steps.append(plan.step)
            self.probes.ratios.append(float(np.median(times)) / self._predicted)
        return timing
