"""validate's verdict on constructed figures: each of the three outcomes, and what gets no allowance."""

from __future__ import annotations

import pytest

from kvsim.realexec.validation import FAIL, INCONCLUSIVE, PASS, Thresholds, allowance, noisy_profile, verdict

T = Thresholds()


def checks(**values: float) -> list[dict]:
    """The eight checks at passing figures, with ``values`` put in."""
    figures = {"decision_identity": 0.0, "step_mape": 0.05, "step_class_median_error": 0.05, "ttft_p50_rel_error": 0.05,
               "tpot_p50_rel_error": 0.05,
               "e2e_p50_rel_error": 0.05, "throughput_rel_error": 0.05, "kv_pool_bytes_rel_error": 0.0, **values}
    limits = {"decision_identity": 0.0, "step_mape": T.step_mape, "step_class_median_error": T.step_mape, "ttft_p50_rel_error": T.ttft_p50,
              "tpot_p50_rel_error": T.tpot_p50, "e2e_p50_rel_error": T.e2e_p50, "throughput_rel_error": T.throughput,
              "kv_pool_bytes_rel_error": T.kv_pool_bytes}
    return [{"name": n, "value": v, "threshold": limits[n], "passed": v <= limits[n]} for n, v in figures.items()]


SPREAD = {"step_mape": 0.04, "step_class_median_error": 0.04, "ttft_p50_rel_error": 0.05, "tpot_p50_rel_error": 0.02,
          "e2e_p50_rel_error": 0.03,
          "throughput_rel_error": 0.01}


def test_every_check_within_its_limit_on_a_machine_that_held_its_speed_passes():
    v = verdict(checks(), SPREAD, {}, moved=0.03, thresholds=T)
    assert (v.outcome, v.exit_code) == ("pass", PASS) and v.line.startswith("validation passed: ")


def test_a_miss_beyond_the_spread_even_at_the_machines_speed_fails():
    v = verdict(checks(ttft_p50_rel_error=0.40), SPREAD, {"ttft_p50_rel_error": 0.38}, moved=0.02, thresholds=T)
    assert (v.outcome, v.exit_code) == ("fail", FAIL)
    assert v.reason.startswith("ttft_p50_rel_error 0.400 over its limit 0.100, and 0.380 with the model at the machine's")


def test_a_miss_the_machines_measured_speed_explains_is_inconclusive():
    """20 % off on a machine that ran 18 % slower than profiled: at that speed the model is 2 % off."""
    v = verdict(checks(step_mape=0.20), SPREAD, {"step_mape": 0.02}, moved=0.18, thresholds=T, advice="try again later")
    assert (v.outcome, v.exit_code) == ("inconclusive", INCONCLUSIVE)
    assert "it moved 18% while measuring" in v.reason and v.reason.endswith("; try again later")


def test_an_inconclusive_verdict_tells_a_cpu_user_to_use_an_accelerator_and_a_device_user_a_longer_step():
    """On a GPU, "rerun it on an accelerator" is no advice: there the small model's sub-millisecond steps are what time unsteadily."""
    from kvsim.realexec.backends.cpu import CpuBackend
    from kvsim.realexec.backends.cuda import CudaBackend
    from kvsim.realexec.backends.npu import NpuBackend

    assert "--backend cuda" in CpuBackend.rerun_advice
    for device in (CudaBackend, NpuBackend):
        assert "--model llama-3.1-8b" in device.rerun_advice and "--backend" not in device.rerun_advice
    for advice in (CpuBackend.rerun_advice, CudaBackend.rerun_advice):
        v = verdict(checks(), SPREAD, {}, moved=0.15, thresholds=T, advice=advice)
        assert v.outcome == "inconclusive" and v.reason.endswith(advice)


def test_a_miss_within_the_real_vs_real_spread_is_inconclusive_and_beyond_it_fails():
    """TTFT p50 12 % off where the run's own repeat moved it 5 %: a model at the limit could show 15 %."""
    inside = verdict(checks(ttft_p50_rel_error=0.12), SPREAD, {"ttft_p50_rel_error": 0.12}, moved=0.0, thresholds=T)
    outside = verdict(checks(ttft_p50_rel_error=0.16), SPREAD, {"ttft_p50_rel_error": 0.16}, moved=0.0, thresholds=T)
    assert inside.outcome == "inconclusive" and outside.outcome == "fail"


def test_a_miss_beyond_the_spread_on_a_machine_shared_differently_from_its_profile_is_inconclusive():
    """The twenty-first session's fail: profiled and run beside a busy process whose load came and went. Where the
    operating system says other processes' load moved between the two, a miss is not read as the model's; a pass stands."""
    from kvsim.cli.validate import shared_differently

    moved = shared_differently({"profile_foreign_cpus": 1.2, "run_foreign_cpus": 0.3})
    assert moved is not None and moved.startswith("1.20 of ") and "0.30 of " in moved
    assert shared_differently({"profile_foreign_cpus": 1.2, "run_foreign_cpus": 1.0}) is None
    assert shared_differently({"profile_foreign_cpus": None, "run_foreign_cpus": 1.0}) is None and shared_differently(None) is None
    miss = verdict(checks(step_mape=0.19), SPREAD, {"step_mape": 0.18}, moved=0.02, thresholds=T, load_moved=moved)
    assert (miss.outcome, miss.exit_code) == ("inconclusive", INCONCLUSIVE)
    assert "but other processes kept 1.20 of " in miss.reason and "busy while the profile was measured" in miss.reason
    assert verdict(checks(step_mape=0.19), SPREAD, {"step_mape": 0.18}, moved=0.02, thresholds=T).outcome == "fail"
    assert verdict(checks(), SPREAD, {}, moved=0.02, thresholds=T, load_moved=moved).outcome == "pass"


def test_a_profile_that_missed_its_own_held_out_steps_carries_no_fail():
    """Round 3's twenty-third session: a fresh round on a VM whose speed moved 12-24 % kept the better of two profiles,
    which still missed its own held-out steps by 11.9 %, and the right model then failed. The held-out error gates
    the profile's use (issue 27): a timing miss it carries is inconclusive; a pass, a decision or a memory miss stand."""
    assert noisy_profile(0.10, T.step_mape) is None and noisy_profile(None, T.step_mape) is None
    noise = noisy_profile(0.119, T.step_mape)
    assert noise == "the profile's fit missed its own held-out steps by 11.9%, more than the step limit 10%"
    miss = verdict(checks(step_mape=0.24), SPREAD, {"step_mape": 0.21}, moved=0.24, thresholds=T, profile_noise=noise)
    assert (miss.outcome, miss.exit_code) == ("inconclusive", INCONCLUSIVE) and f"but {noise}:" in miss.reason
    assert verdict(checks(step_mape=0.24), SPREAD, {"step_mape": 0.21}, moved=0.24, thresholds=T).outcome == "fail"
    assert verdict(checks(), SPREAD, {}, moved=0.02, thresholds=T, profile_noise=noise).outcome == "pass"
    for name in ("decision_identity", "kv_pool_bytes_rel_error"):  # no machine explains these, nor a shared one
        for gate in ({"profile_noise": noise}, {"load_moved": "1.20 of 2 CPUs busy"}):
            assert verdict(checks(**{name: 1.0}, step_mape=0.3), SPREAD, {}, moved=0.0, thresholds=T, **gate).outcome == "fail"


def test_the_step_mape_allowance_adds_in_quadrature_and_a_single_figure_linearly():
    assert allowance("step_mape", 0.10, 0.05) == pytest.approx((0.10**2 + 0.05**2) ** 0.5)
    assert allowance("ttft_p50_rel_error", 0.10, 0.05) == pytest.approx(0.15)
    # a model 20 % slow on a machine whose steps move 8 % when measured again still fails the step check
    v = verdict(checks(step_mape=0.19), SPREAD | {"step_mape": 0.08}, {"step_mape": 0.19}, moved=0.01, thresholds=T)
    assert v.outcome == "fail"


def test_the_line_names_the_miss_farthest_beyond_its_allowance():
    """The step MAPE just past its allowance and throughput far past its own: the line leads with throughput,
    though the check list holds the steps first."""
    v = verdict(checks(step_mape=0.12, throughput_rel_error=0.50), SPREAD, {"step_mape": 0.12, "throughput_rel_error": 0.5},
                moved=0.0, thresholds=T)
    assert v.outcome == "fail" and v.reason.startswith("throughput_rel_error 0.500") and "(and 1 more)" in v.reason
    # a decision miss has no allowance at all: it leads whatever the timing checks show
    v = verdict(checks(decision_identity=1.0, step_mape=0.9), SPREAD, {}, moved=0.0, thresholds=T)
    assert v.reason.startswith("decision_identity")


def test_every_check_passing_while_the_machine_moved_past_the_step_limit_is_inconclusive():
    """A model 15 % slow on a machine that ran 15 % slow passes every check: that pass says nothing."""
    v = verdict(checks(), SPREAD, {}, moved=0.15, thresholds=T)
    assert (v.outcome, v.exit_code) == ("inconclusive", INCONCLUSIVE) and "moved 15%" in v.reason


def test_decisions_and_memory_get_no_allowance():
    for name in ("decision_identity", "kv_pool_bytes_rel_error"):
        v = verdict(checks(**{name: 1.0}), SPREAD, {}, moved=0.30, thresholds=T)
        assert (v.outcome, v.exit_code) == ("fail", FAIL) and v.reason.startswith(name)


def test_a_stricter_user_threshold_is_the_one_weighed():
    strict = Thresholds(ttft_p50=0.02)
    c = checks()
    for check in c:
        if check["name"] == "ttft_p50_rel_error":
            check.update(threshold=0.02, passed=False)
    v = verdict(c, SPREAD | {"ttft_p50_rel_error": 0.01}, {"ttft_p50_rel_error": 0.05}, moved=0.0, thresholds=strict)
    assert v.outcome == "fail" and "over its limit 0.020" in v.reason



def test_a_miss_that_the_profiles_own_fit_ratio_explains_is_inconclusive_and_says_so():
    """The run of 2026-11-27 that failed a right model: TPOT p50 0.203 off, 0.156 at the machine's speed, from a
    profile whose reference steps had taken 1.16x its fit's prediction when it was measured. With the model
    scaled by that too (cross_validate's extra speeds) the miss is 0.04: inconclusive, and the line says why."""
    spread = SPREAD | {"tpot_p50_rel_error": 0.023}
    v = verdict(checks(tpot_p50_rel_error=0.203), spread, {"tpot_p50_rel_error": 0.04}, moved=0.06, thresholds=T,
                fit_ratio=1.16)
    assert v.outcome == "inconclusive"
    assert ("(it moved 6% while measuring), or 1.16x that where the profile's fit landed against its own reference "
            "steps, within") in v.reason
    plain = verdict(checks(tpot_p50_rel_error=0.203), spread, {"tpot_p50_rel_error": 0.156}, moved=0.06, thresholds=T)
    assert plain.outcome == "fail" and "landed" not in plain.reason


def test_a_class_of_steps_the_model_misses_fails_its_check_where_the_run_wide_mape_hides_it():
    """200 one-sequence decodes predicted exactly, 40 two-sequence ones 30 % short (a profile without its
    row-count terms, say): the MAPE is 0.05, the class check reads the two-sequence class's 0.3.
    Ten mixed steps 50 % off are too few to be judged on their own."""
    from kvsim.realexec.validation import step_errors, validate_runs

    measured = [1.0] * 200 + [1.0] * 40 + [1.0] * 10
    predicted = [1.0] * 200 + [0.7] * 40 + [0.5] * 10
    kinds, sizes = ["decode"] * 240 + ["mixed"] * 10, [1] * 200 + [2] * 40 + [3] * 10
    errors = step_errors(predicted, measured, kinds, sizes)
    assert set(errors["by_class"]) == {"decode x1", "decode x2"}
    assert errors["class_median_error"] == pytest.approx(0.3)
    summary = {"ttft_s": {"p50": 1.0, "p99": 1.0}, "tpot_s": {"p50": 1.0, "p99": 1.0}, "e2e_s": {"p50": 1.0, "p99": 1.0},
               "throughput_tok_s": 1.0, "duration_s": 1.0, "peak_kv_blocks_used": 1, "preemptions": 0}
    checks = {c["name"]: c for c in validate_runs(measured, summary, summary, {"identical": True}, predicted, kinds, sizes,
                                                   1, 1, Thresholds())["checks"]}
    assert checks["step_mape"]["passed"] and not checks["step_class_median_error"]["passed"]
    assert checks["step_class_median_error"]["threshold"] == Thresholds().step_mape


def test_with_no_class_of_twenty_steps_the_largest_class_is_judged():
    from kvsim.realexec.validation import worst_class_error

    assert worst_class_error([1.2] * 5 + [1.0] * 3, ["decode x1"] * 5 + ["prefill x1"] * 3) == pytest.approx(0.2)
    assert worst_class_error([], []) is None
