"""How far a real run's own figures move when measured again: what ``kvsim validate``'s verdict weighs errors against.

Two measurements, both taken during the validate run itself (docs/validate-verdict.md says why
these and not a second run of the trace):

- **Real vs real**: the executor times each step's forward pass several times and keeps the median;
  it also keeps the median of the even runs and that of the odd runs (``Executor.half_runs_s``):
  two measurements of every step, interleaved run by run, so a drift of the machine hits both
  alike. Each is replayed through the engine (the same trace, the same scheduler) and every
  metric the checks read is computed from both: how far the two lie apart, over the real run's
  figure, is that metric's real-vs-real spread. For the per-step MAPE it is the mean |a - b| / measured.
- **The machine's speed**: the speed check's reference steps, timed before and after the real run,
  over their times when the profile was measured (:func:`bracket`): 1.12 = this machine ran
  12 % slower than when profiled. A model can only be judged against the machine it was fitted on;
  the verdict scales the model by each of these speeds and asks whether the error is then explained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kvsim.policies.plan import PlanDetail, StepPlan
from kvsim.policies.request import Request
from kvsim.realexec.speed_check import SpeedCheck
from kvsim.sim.perf.device import DeviceProfile
from kvsim.sim.perf.step_timer import StepTiming
from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.simulator import SimOptions, simulate
from kvsim.traces.schema import Trace

# The summary's figures each latency check reads: check name -> (summary key, statistic).
LATENCY_CHECKS = {
    "ttft_p50_rel_error": ("ttft_s", "p50"),
    "tpot_p50_rel_error": ("tpot_s", "p50"),
    "e2e_p50_rel_error": ("e2e_s", "p50"),
}
TIMING_CHECKS = ("step_mape", *LATENCY_CHECKS, "throughput_rel_error")


class RecordedTimer:
    """Recorded step durations in order; past the record (a replay that scheduled more steps), ``fallback``'s prediction."""

    plan_detail = PlanDetail.TOTALS  # durations need no plan; the fallback prediction reads the totals

    def __init__(self, durations: list[float], fallback: Callable[[StepPlan], float]) -> None:
        self.durations, self.fallback = durations, fallback
        self.beyond_record = 0
        self._next = 0

    def add_request(self, request: Request) -> None:
        """Recorded durations need no per-request state."""

    def step(self, plan: StepPlan) -> StepTiming:
        if self._next < len(self.durations):
            duration = self.durations[self._next]
        else:
            duration = self.fallback(plan)
            self.beyond_record += 1
        self._next += 1
        return StepTiming(duration_s=duration)


def metric(summary: dict, check: str) -> float | None:
    """The figure of a summary that ``check`` compares (a latency percentile or the throughput)."""
    if check == "throughput_rel_error":
        return summary["throughput_tok_s"]
    key, statistic = LATENCY_CHECKS[check]
    return summary[key][statistic]


def replayed_summary(
    resolved: ResolvedRun, trace: Trace, durations: list[float], fallback: Callable[[StepPlan], float]
) -> tuple[dict, int]:
    """The summary of the trace run through the engine with ``durations`` as its steps' times, and how many steps ran past them."""
    timer = RecordedTimer(durations, fallback)
    run = simulate(trace, resolved.new_engine(), timer, SimOptions())
    return run.summary(), timer.beyond_record


def real_vs_real(resolved: ResolvedRun, trace: Trace, measured: list[float], half_runs: list[tuple[float, float]],
                 real_summary: dict, fallback: Callable[[StepPlan], float]) -> dict:
    """Every timing check's real-vs-real spread, from the two interleaved halves of the step timings (module docstring)."""
    a, b = (np.array([pair[k] for pair in half_runs]) for k in (0, 1))
    steps = np.asarray(measured)
    spreads = {"step_mape": float(np.mean(np.abs(a - b) / steps)) if steps.size else 0.0}
    halves, beyond = [], 0
    for durations in (a.tolist(), b.tolist()):
        summary, past = replayed_summary(resolved, trace, durations, fallback)
        halves.append(summary)
        beyond += past
    for check in TIMING_CHECKS[1:]:
        real, first, second = metric(real_summary, check), metric(halves[0], check), metric(halves[1], check)
        spreads[check] = None if None in (real, first, second) or real == 0 else abs(first - second) / abs(real)
    return {"spread": spreads, "halves": {check: [metric(h, check) for h in halves] for check in TIMING_CHECKS[1:]},
            "steps_past_the_record": beyond}


def bracket(before: SpeedCheck, after: SpeedCheck) -> Bracket:
    """The machine's speed before and after the real run: the reference steps' median time over the
    times the profile recorded (1.12: 12 % slower than when profiled). A profile that recorded none
    (one not made by ``kvsim profile``): over the first check, so only the move during the run shows.
    """
    if before.profiled_s and after.profiled_s:
        return Bracket(_median_ratio(before.measured_s, before.profiled_s), _median_ratio(after.measured_s, after.profiled_s))
    return Bracket(1.0, _median_ratio(after.measured_s, before.measured_s))


def _median_ratio(measured: list[float], baseline: list[float]) -> float:
    return float(np.median(np.array(measured) / np.array(baseline)))


def scaled_device(device: DeviceProfile, factor: float, row_count_terms: bool = True) -> DeviceProfile:
    """``device`` with every operator's time multiplied by ``factor`` (and its row-count terms, or none).

    Per-call costs times ``factor``, efficiencies over it, so each operator's roofline time
    ``max(flops / (peak e_c), bytes / (bw e_m)) + calls c`` is ``factor`` times as long. Shape
    terms and roofs stay. With an engine (graph replay, async scheduling) the step's overlap
    follows from the scaled operator times; the CPU profile has none, so its steps scale exactly.
    """
    operators = {
        op: replace(c, call_s=c.call_s * factor,
                    compute_efficiency=None if c.compute_efficiency is None else c.compute_efficiency / factor,
                    memory_efficiency=None if c.memory_efficiency is None else c.memory_efficiency / factor)
        for op, c in device.operators.items()
    }
    rows = {n: s * factor for n, s in device.row_count_s.items()} if row_count_terms else {}
    return replace(device.with_operators(operators), row_count_s=rows)


@dataclass(frozen=True)
class Bracket:
    """The machine's speed (:func:`bracket`) before and after the real run."""

    before: float
    after: float

    @property
    def speeds(self) -> tuple[float, ...]:
        """The speeds the run may have run at: both ends and their mean, once each."""
        return tuple(dict.fromkeys((self.before, (self.before + self.after) / 2, self.after)))

    @property
    def moved(self) -> float:
        """The largest |speed - 1| at either end: how far the machine strayed from its profile while measuring."""
        return max(abs(self.before - 1.0), abs(self.after - 1.0))
