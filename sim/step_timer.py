"""The step-timer slot: what turns a StepPlan into a duration.

The simulator's driver calls ``add_request`` for every request it hands the engine and
``step`` for every plan; the cost model answers with a prediction, the real executor runs
the plan on a device and answers with a measurement. Nothing here may change a decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from policies.plan import StepPlan
from policies.request import Request


@dataclass
class StepTiming:
    duration_s: float  # what the simulated clock advances by
    device_s: float | None = None  # measured device time (real executor only)
    host_s: float | None = None  # measured host overhead: building inputs, sampling, Python
    memory_bytes: int | None = None  # measured device memory in use after the step
    operators: dict[str, float] = field(default_factory=dict)  # per-operator split, where known


class StepTimer(Protocol):
    def add_request(self, request: Request) -> None:
        """A new request entered the engine (children of forks arrive through ``plan.forks``)."""

    def step(self, plan: StepPlan) -> StepTiming:
        """Execute or predict one plan."""
