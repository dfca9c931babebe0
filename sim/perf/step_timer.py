"""The step-timer slot: what turns a StepPlan into a duration.

The simulator's driver calls ``add_request`` for every request it hands the engine and
``step`` for every plan; the cost model answers with a prediction, the real executor runs
the plan on a device and answers with a measurement. Nothing here may change a decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvsim.policies.plan import PlanDetail, StepPlan
from kvsim.policies.request import Request


@dataclass
class StepTiming:
    duration_s: float  # what the simulated clock advances by
    device_s: float | None = None  # measured device time (real executor only)
    host_s: float | None = None  # measured host overhead: building inputs, sampling, Python
    memory_bytes: int | None = None  # measured device memory in use after the step
    operators: dict[str, float] = field(default_factory=dict)  # per-operator split, where known


class StepTimer(Protocol):
    """``plan_detail``: what the timer reads of a plan (an executor every slot; the cost model
    the totals): the simulator asks the engine for no more than its readers need."""

    plan_detail: PlanDetail

    def add_request(self, request: Request) -> None:
        """A new request entered the engine (children of forks arrive through ``plan.forks``)."""

    def step(self, plan: StepPlan) -> StepTiming:
        """Execute or predict one plan."""


class ReplayTimer:
    """Replays recorded step durations in order: the simulator re-run with a real run's times.

    With a ``predict`` function it also records what that model says of each replayed plan,
    so a cost model can be scored on exactly the plans the device ran.
    """

    plan_detail = PlanDetail.SLOTS  # whole plans, as the device ran them (batch sizes count their entries)

    def __init__(self, durations: list[float], predict=None) -> None:
        self.durations = durations
        self.predict = predict
        self.predicted: list[float] = []
        self.kinds: list[str] = []
        self.batch_sizes: list[int] = []
        self._next = 0

    def add_request(self, request: Request) -> None:
        """Recorded durations need no per-request state."""

    def step(self, plan: StepPlan) -> StepTiming:
        if self._next >= len(self.durations):
            raise RuntimeError(f"replay asked for step {self._next}, but only {len(self.durations)} were recorded")
        duration = self.durations[self._next]
        self._next += 1
        if self.predict is not None:
            self.predicted.append(self.predict(plan))
            self.kinds.append(plan.kind)
            self.batch_sizes.append(len(plan.entries))
        return StepTiming(duration_s=duration)
