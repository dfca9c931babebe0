"""The real-vs-real spread and the machine's speed that validate's verdict weighs a miss against (no executor here:
the 'real' step times are the cost model's, so every figure below is known exactly)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsim.cli.execute import REAL_DEFAULTS
from kvsim.realexec.repeatability import (
    DriftTimer,
    TimedSteps,
    drift,
    errors_at_speeds,
    machine_speed,
    one_engine,
    real_vs_real,
)
from kvsim.realexec.speed_check import SpeedCheck
from kvsim.realexec.validation import step_classes
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.perf.device import scaled_profile
from kvsim.sim.perf.step_timer import ReplayTimer
from kvsim.sim.run.config import load_run_trace, resolve
from kvsim.sim.run.simulator import SimOptions, simulate

CONFIG = REAL_DEFAULTS.updated(model="tiny", max_requests=12, num_blocks=48)


@pytest.fixture(scope="module")
def run():
    """A 'real' run whose steps took exactly the cost model's prediction: its steps, the predictions, its summary."""
    resolved = resolve(CONFIG)
    trace = load_run_trace(CONFIG)
    cost = resolved.cost_model()
    sim = simulate(trace, resolved.new_engine(), CostModelTimer(cost), SimOptions())
    measured = [d for d, t in zip(sim.steps.column("duration_s"), sim.steps.column("timed")) if t]
    replay = ReplayTimer(measured, predict=cost.step_time)
    summary = simulate(trace, resolved.new_engine(), replay, SimOptions()).summary()
    return resolved, trace, measured, replay.predicted, summary, step_classes(replay.kinds, replay.batch_sizes)


def scaled_profile_model(resolved, factor: float):
    """The run's cost model with every operator ``factor`` times as slow."""
    return dataclasses.replace(resolved, device=scaled_profile(resolved.device, factor)).cost_model()


def test_drift_keeps_the_slow_move_and_drops_one_steps_jitter():
    measured = np.ones(200)
    again = np.where(np.arange(200) < 100, 1.0, 1.2) * measured
    again[50] = 3.0  # one step's jitter
    d = drift(again.tolist(), measured.tolist())
    assert d[50] == pytest.approx(1.0) and d[10] == pytest.approx(1.0) and d[190] == pytest.approx(1.2)


def test_steps_timed_again_alike_leave_every_figure_where_it_was(run):
    resolved, trace, measured, predicted, summary, classes = run
    again = real_vs_real([TimedSteps(measured, predicted, resolved.cost_model().step_time, classes)], [[measured, measured]], summary,
                         one_engine(resolved, trace)[0])
    assert again["spread"]["step_mape"] == 0.0 and all(v == pytest.approx(0.0, abs=1e-12) for v in again["spread"].values())
    assert again["steps_unlike_the_run"] == [0, 0] and again["pass_speed"] == [1.0, 1.0]


def test_a_machine_slower_when_measured_again_moves_the_figures_by_at_least_that_much(run):
    """All steps 10 % slower the second time: the step spread is 0.10, and TPOT (every token a step) moves 10 % or more."""
    resolved, trace, measured, predicted, summary, classes = run
    slower = [m * 1.1 for m in measured]
    again = real_vs_real([TimedSteps(measured, predicted, resolved.cost_model().step_time, classes)], [[measured, slower]], summary,
                         one_engine(resolved, trace)[0])
    assert again["spread"]["step_mape"] == pytest.approx(0.10) and again["spread"]["step_class_median_error"] == pytest.approx(0.10)
    assert again["spread"]["tpot_p50_rel_error"] >= 0.10 - 1e-9
    assert again["pass_speed"] == [pytest.approx(1.0), pytest.approx(1.1)]


def test_the_drift_timer_times_the_runs_own_plans_by_measurement_and_others_by_the_model_at_the_local_ratio(run):
    resolved, trace, measured, predicted, summary, _ = run
    cost = resolved.cost_model()
    same = DriftTimer(np.asarray(measured), np.asarray(predicted), np.ones(len(measured)), cost.step_time)
    replayed = simulate(trace, resolved.new_engine(), same, SimOptions()).summary()
    assert {k: v for k, v in replayed.items() if k != "wall_s"} == {k: v for k, v in summary.items() if k != "wall_s"}
    assert same.unlike == 0
    # no plan matches a prediction the model never made: every step is the model's time at the local ratio (2x), times 1.5
    unlike = DriftTimer(np.asarray(measured), np.asarray(predicted) * 0.5, np.full(len(measured), 1.5), cost.step_time)
    steps = simulate(trace, resolved.new_engine(), unlike, SimOptions()).steps
    durations = [d for d, t in zip(steps.column("duration_s"), steps.column("timed")) if t]
    assert unlike.unlike == len(durations) > 0
    three_times = CostModelTimer(scaled_profile_model(resolved, 3.0))
    expected = simulate(trace, resolved.new_engine(), three_times, SimOptions()).steps.column("duration_s")
    assert durations == pytest.approx([d for d, t in zip(expected, steps.column("timed")) if t], rel=1e-9)


def test_the_machines_speed_reads_the_profiled_times_not_the_prediction():
    before = SpeedCheck(["a", "b", "c"], [1.0, 2.0, 3.0], predicted_s=[0.5, 1.0, 1.5], profiled_s=[1.0, 2.0, 3.0])
    after = SpeedCheck(["a", "b", "c"], [1.2, 2.4, 3.6], predicted_s=[0.5, 1.0, 1.5], profiled_s=[1.0, 2.0, 3.0])
    speed = machine_speed(before, after)
    assert (speed.before, speed.after) == (pytest.approx(1.0), pytest.approx(1.2)) and speed.moved == pytest.approx(0.2)
    assert speed.speeds == (pytest.approx(1.0), pytest.approx(1.1), pytest.approx(1.2))
    during = dataclasses.replace(speed, passes=(0.95, 0.86))  # the run's steps timed again read 14 % faster than in the run
    assert during.moved == pytest.approx(0.2) and dataclasses.replace(speed, after=1.0, passes=(0.95, 0.86)).moved == pytest.approx(0.14)
    assert during.speeds == speed.speeds  # the model is scaled to the ends' speeds only
    assert speed.speeds_at_fit(None) == speed.speeds_at_fit(1.0) == speed.speeds
    assert speed.speeds_at_fit(1.1) == pytest.approx((1.0, 1.1, 1.2, 1.1, 1.21, 1.32))  # and where the fit landed
    unrecorded = machine_speed(SpeedCheck(["a"], [1.0], [0.5]), SpeedCheck(["a"], [1.3], [0.5]))
    assert (unrecorded.before, unrecorded.after) == (1.0, pytest.approx(1.3))  # only the move during the run shows


def test_errors_at_the_machines_speed_find_the_speed_that_explains_a_uniform_slowdown(run):
    """A 'real' run on a machine 25 % slower than profiled: at speed 1.25 the model explains it exactly, at 1.0 not."""
    resolved, trace, _, _, _, _ = run
    slow = simulate(trace, resolved.new_engine(), CostModelTimer(scaled_profile_model(resolved, 1.25)), SimOptions())
    measured = [d for d, t in zip(slow.steps.column("duration_s"), slow.steps.column("timed")) if t]
    replay = ReplayTimer(measured, predict=resolved.cost_model().step_time)
    simulate(trace, resolved.new_engine(), replay, SimOptions())
    engines = [TimedSteps(measured, replay.predicted, resolved.cost_model().step_time, step_classes(replay.kinds, replay.batch_sizes))]
    at_speed = errors_at_speeds(engines, slow.summary(), (1.0, 1.25), one_engine(resolved, trace)[1])
    assert at_speed["step_mape"] == pytest.approx(0.0, abs=1e-9) and at_speed["step_class_median_error"] == pytest.approx(0.0, abs=1e-9)
    assert at_speed["tpot_p50_rel_error"] == pytest.approx(0.0, abs=1e-9)
    only_profiled = errors_at_speeds(engines, slow.summary(), (1.0,), one_engine(resolved, trace)[1])
    assert only_profiled["step_mape"] == pytest.approx(0.2) and only_profiled["step_class_median_error"] == pytest.approx(0.2)
