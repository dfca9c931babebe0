"""How far a real run's own figures move when measured again: what ``kvsim validate``'s verdict weighs a miss against.

Two measurements, both taken by the validate run itself (docs/validate-verdict.md says why these):

- **The machine's speed**: the speed check's reference steps, timed before and after the real
  run, over their times when the profile was measured (:func:`machine_speed`): 1.12 = the
  machine ran 12 % slower than when profiled. It reads no prediction, so a wrong model cannot
  pass for a moved machine. The verdict scales the model by the speeds the machine ran at and
  asks whether a miss is then explained.
- **Real vs real**: once the real run is over, its steps are timed again, pass after pass over
  the whole run (``Executor.retime``), so each step's second measurement lies minutes from its
  first. A pass times each step once, where the run kept the median of several runs: its
  single-run jitter is not the run's, so what a pass keeps is the machine's drift alone, the
  ratio of its steps to the run's, as a running median over :data:`DRIFT_WINDOW` neighbouring
  steps (:func:`drift`). The run's steps times that drift are the run measured again; replayed
  through the engine (the same trace and scheduler, :class:`DriftTimer`), every figure the checks
  read is computed from it, and how far those lie from the real run's own is that figure's
  real-vs-real spread. For the per-step MAPE it is the mean |drift - 1|.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvsim.policies.plan import PlanDetail, StepPlan
from kvsim.policies.request import Request
from kvsim.realexec.speed_check import SpeedCheck
from kvsim.realexec.validation import rel_error, worst_class_error
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.perf.device import scaled_profile
from kvsim.sim.perf.step_timer import StepTimer, StepTiming
from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.simulator import SimOptions, simulate
from kvsim.traces.schema import Trace

# The summary figure each latency check reads: check name -> (summary key, statistic).
LATENCY_CHECKS = {
    "ttft_p50_rel_error": ("ttft_s", "p50"),
    "tpot_p50_rel_error": ("tpot_s", "p50"),
    "e2e_p50_rel_error": ("e2e_s", "p50"),
}
SUMMARY_CHECKS = (*LATENCY_CHECKS, "throughput_rel_error")
TIMING_CHECKS = ("step_mape", "step_class_median_error", *SUMMARY_CHECKS)
DRIFT_WINDOW = 15  # steps each side of a step whose pass-over-run ratios give its drift (docs/validate-verdict.md)


def metric(summary: dict, check: str) -> float | None:
    """The figure of a run summary that ``check`` compares (a latency percentile or the throughput)."""
    if check == "throughput_rel_error":
        return summary["throughput_tok_s"]
    key, statistic = LATENCY_CHECKS[check]
    return summary[key][statistic]


def running_median(values: np.ndarray, window: int = DRIFT_WINDOW) -> np.ndarray:
    """Each value's median with the ``window`` values on either side."""
    return np.array([np.median(values[max(0, i - window): i + window + 1]) for i in range(len(values))])


def drift(again: list[float], measured: list[float]) -> np.ndarray:
    """Each step's time measured again over its time in the run, as a running median over its neighbours.

    One step's ratio is mostly the pass's single-run jitter; the median of its neighbours keeps
    what moves slowly: the machine's speed between the run and the pass.
    """
    return running_median(np.asarray(again) / np.asarray(measured))


class DriftTimer:
    """The real run's steps at another moment's speed: each step's measured time times its drift.

    With other times the engine may plan otherwise (a request arrives before or after a step
    ends), as a second real run would; a plan unlike the run's step of the same index has no
    measurement, so it takes the model's prediction times the run's measured-over-predicted
    ratio around that step (:func:`drift`'s running median), times the drift.
    """

    plan_detail = PlanDetail.SLOTS  # the plans the device ran were whole: predicted alike to match them

    def __init__(self, measured: np.ndarray, predicted: np.ndarray, drift: np.ndarray, predict: Callable[[StepPlan], float]):
        self.measured, self.predicted, self.drift, self.predict = measured, predicted, drift, predict
        self.model_ratio = running_median(measured / predicted)
        self.unlike = 0  # steps whose plan differed from the run's
        self._next = 0

    def add_request(self, request: Request) -> None:
        """Recorded durations need no per-request state."""

    def step(self, plan: StepPlan) -> StepTiming:
        recorded = self._next < len(self.measured)  # past the run's last step: its neighbours' ratio and drift
        i = self._next if recorded else len(self.measured) - 1
        self._next += 1
        predicted = self.predict(plan)
        if recorded and predicted == self.predicted[i]:
            return StepTiming(duration_s=float(self.measured[i] * self.drift[i]))
        self.unlike += 1
        return StepTiming(duration_s=float(predicted * self.model_ratio[i] * self.drift[i]))


@dataclass(frozen=True)
class TimedSteps:
    """One engine's timed steps in a real run (a P/D pair has two engines): each step's measured time,
    the model's prediction of it, the model, which times plans unlike the run's, and each step's class
    (``validation.step_classes``)."""

    measured: list[float]
    predicted: list[float]
    predict: Callable[[StepPlan], float]
    classes: list[str]


Replay = Callable[[list[StepTimer]], dict]  # the run's trace again with these step timers (one an engine): its summary
AtSpeed = Callable[[float], dict]  # the run's trace simulated with every operator this many times as slow: its summary


def one_engine(resolved: ResolvedRun, trace: Trace) -> tuple[Replay, AtSpeed]:
    """:data:`Replay` and :data:`AtSpeed` for a run of one engine."""
    def replay(timers: list[StepTimer]) -> dict:
        (timer,) = timers
        return simulate(trace, resolved.new_engine(), timer, SimOptions()).summary()

    def at_speed(speed: float) -> dict:
        scaled = at_machine_speed(resolved, speed)
        return simulate(trace, scaled.new_engine(), CostModelTimer(scaled.cost_model()), SimOptions()).summary()

    return replay, at_speed


def at_machine_speed(resolved: ResolvedRun, speed: float) -> ResolvedRun:
    """``resolved`` with every operator time scaled by ``speed``."""
    return replace(resolved, device=scaled_profile(resolved.device, speed, why="at the machine's measured speed"))


def real_vs_real(engines: list[TimedSteps], passes: list[list[list[float]]], real_summary: dict, replay: Replay) -> dict:
    """Every timing check's real-vs-real spread, from the run's steps timed again (module docstring).

    ``passes[e]``: engine ``e``'s steps timed again, one list a pass. A figure's spread is its
    largest move over the passes, each the run's steps times its :func:`drift` replayed through
    the engines (:class:`DriftTimer`, one an engine).
    """
    steps = [np.asarray(e.measured) for e in engines]
    classes = np.concatenate([np.asarray(e.classes, dtype=str) for e in engines])
    per_pass = list(zip(*[[drift(again, e.measured) for again in engine_passes] for e, engine_passes in zip(engines, passes)]))
    if not sum(s.size for s in steps):
        per_pass = []
    spread: dict[str, float | None] = {
        "step_mape": max((float(np.mean(np.abs(np.concatenate(d) - 1.0))) for d in per_pass), default=None),
        "step_class_median_error": max((worst_class_error(np.concatenate(d), classes) for d in per_pass), default=None),
    }
    figures: dict[str, list[float | None]] = {check: [] for check in SUMMARY_CHECKS}
    unlike = []
    for drifts in per_pass:
        timers = [DriftTimer(m, np.asarray(e.predicted), d, e.predict) for m, e, d in zip(steps, engines, drifts)]
        summary = replay(timers)
        unlike.append(sum(t.unlike for t in timers))
        for check in SUMMARY_CHECKS:
            figures[check].append(metric(summary, check))
    for check in SUMMARY_CHECKS:
        moves = [rel_error(value, metric(real_summary, check)) for value in figures[check]]
        spread[check] = None if None in moves else max(moves)
    return {
        "passes": len(per_pass),
        "spread": spread,
        "figures": figures,
        "pass_speed": [float(np.median(np.concatenate(d))) for d in per_pass],  # each pass's steps over the run's
        "steps_unlike_the_run": unlike,  # per pass: planned otherwise than the run, so timed by the model
    }


@dataclass(frozen=True)
class MachineSpeed:
    """The machine's speed around and during the real run: the reference steps' time over their time when
    profiled, before and after it; and each pass's median of the run's steps timed again over their time
    in the run (``real_vs_real``'s ``pass_speed``), which shows a move during the run that the ends miss."""

    before: float
    after: float
    passes: tuple[float, ...] = ()

    @property
    def speeds(self) -> tuple[float, ...]:
        """The speeds the run may have run at: both ends and their mean, once each."""
        return tuple(dict.fromkeys((self.before, (self.before + self.after) / 2, self.after)))

    def speeds_at_fit(self, fit: float | None) -> tuple[float, ...]:
        """:attr:`speeds`, and each times ``fit`` (where the profile's fit landed against its own reference
        steps; None or 1: not recorded or on the mark): every speed the verdict weighs a miss at."""
        return self.speeds if fit in (None, 1.0) else (*self.speeds, *(s * fit for s in self.speeds))

    @property
    def moved(self) -> float:
        """The largest |speed - 1| at either end, or of a pass against the run: how far the machine strayed while measuring.

        On an H200 a biased model passed while both ends read 1.01-1.03x and the run's steps, timed
        again, read 0.86x: the run had met a slower machine than the checks around it did."""
        return max(abs(self.before - 1.0), abs(self.after - 1.0), *(abs(p - 1.0) for p in self.passes))

    def to_dict(self) -> dict:
        return {"before": self.before, "after": self.after, "passes": list(self.passes), "moved": self.moved}


def machine_speed(before: SpeedCheck, after: SpeedCheck, passes: Sequence[float] = ()) -> MachineSpeed:
    """The reference steps' median time over the times the profile recorded, before and after the run,
    with ``passes`` (the run's steps timed again over their time in the run, a median a pass).

    A profile that recorded none (one not made by ``kvsim profile``): over the first check, so
    only the move during the run shows.
    """
    if before.profiled_s and after.profiled_s:
        return MachineSpeed(before.machine_ratio, after.machine_ratio, tuple(passes))
    return MachineSpeed(1.0, float(np.median(np.asarray(after.measured_s) / np.asarray(before.measured_s))), tuple(passes))


def errors_at_speeds(engines: list[TimedSteps], real_summary: dict, speeds: tuple[float, ...], at_speed: AtSpeed,
                     ) -> dict[str, float | None]:
    """Each timing check's least error over the model scaled to each of ``speeds`` (the machine's, while measuring).

    The per-step predictions scale exactly; the latency figures come from the trace simulated
    again with every operator time scaled (``at_speed``).
    """
    steps = np.concatenate([np.asarray(e.measured, dtype=float) for e in engines])
    model = np.concatenate([np.asarray(e.predicted, dtype=float) for e in engines])
    classes = np.concatenate([np.asarray(e.classes, dtype=str) for e in engines])
    best: dict[str, float | None] = {check: None for check in TIMING_CHECKS}

    def keep(check: str, error: float | None) -> None:
        if error is not None and (best[check] is None or error < best[check]):
            best[check] = error

    for speed in speeds:
        if steps.size:
            keep("step_mape", float(np.mean(np.abs(model * speed - steps) / steps)))
            keep("step_class_median_error", worst_class_error(model * speed / steps, classes))
        summary = at_speed(speed)
        for check in SUMMARY_CHECKS:
            keep(check, rel_error(metric(summary, check), metric(real_summary, check)))
    return best
