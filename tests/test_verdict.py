"""``kvsim validate``'s verdict on constructed figures: pass, fail and inconclusive, each with its exit code and reason."""

from __future__ import annotations

import pytest

from kvsim.realexec.validation import FAIL, INCONCLUSIVE, PASS, Thresholds, verdict

LIMITS = Thresholds()
TIMING = ("step_mape", "ttft_p50_rel_error", "tpot_p50_rel_error", "e2e_p50_rel_error", "throughput_rel_error")


def checks(**values: float) -> list[dict]:
    """The seven checks at the default limits, every figure 0.02 unless given."""
    limits = {"step_mape": LIMITS.step_mape, "ttft_p50_rel_error": LIMITS.ttft_p50, "tpot_p50_rel_error": LIMITS.tpot_p50,
              "e2e_p50_rel_error": LIMITS.e2e_p50, "throughput_rel_error": LIMITS.throughput,
              "kv_pool_bytes_rel_error": LIMITS.kv_pool_bytes}
    out = [{"name": "decision_identity", "value": values.get("decision_identity", 0.0), "threshold": 0.0}]
    out += [{"name": name, "value": values.get(name, 0.02 if name != "kv_pool_bytes_rel_error" else 0.0), "threshold": limit}
            for name, limit in limits.items()]
    for c in out:
        c["passed"] = c["value"] <= c["threshold"]
    return out


def spread(value: float = 0.02) -> dict[str, float]:
    return dict.fromkeys(TIMING, value)


def test_a_model_within_every_limit_on_a_steady_machine_passes() -> None:
    figures = checks(step_mape=0.04, ttft_p50_rel_error=0.08)
    result = verdict(figures, spread(), {c["name"]: c["value"] for c in figures}, moved=0.03, thresholds=LIMITS)
    assert (result.outcome, result.exit_code) == ("pass", PASS) == ("pass", 0)
    assert result.line == "validation passed: every check within its limit, the machine within 3% of its profiled speed"


def test_a_model_20_percent_off_on_a_steady_machine_fails_naming_the_check() -> None:
    """A 1.2x profile: step MAPE 0.19 with a real-vs-real spread of 0.02 and the machine where it was profiled."""
    figures = checks(step_mape=0.19, tpot_p50_rel_error=0.21)
    explained = {"step_mape": 0.18, "tpot_p50_rel_error": 0.20, **{n: 0.02 for n in TIMING[1:] if n != "tpot_p50_rel_error"}}
    result = verdict(figures, spread(), explained, moved=0.01, thresholds=LIMITS)
    assert (result.outcome, result.exit_code) == ("fail", FAIL) == ("fail", 1)
    assert result.reason.startswith("step_mape 0.190 over its limit 0.100, and 0.180 with the model at the machine's measured speed: "
                                    "beyond the limit plus the run's real-vs-real spread 0.020 (and 1 more)")
    assert result.line.startswith("validation failed: step_mape")


def test_a_miss_the_machines_speed_explains_is_inconclusive_and_says_by_how_much_and_what_to_do() -> None:
    """Issue 27's run 1: the machine ran 12 % slower than profiled; at that speed the model is within its limits."""
    figures = checks(step_mape=0.12, ttft_p50_rel_error=0.113, tpot_p50_rel_error=0.114)
    explained = {**dict.fromkeys(TIMING, 0.03)}
    result = verdict(figures, spread(0.02), explained, moved=0.12, thresholds=LIMITS)
    assert (result.outcome, result.exit_code) == ("inconclusive", INCONCLUSIVE) == ("inconclusive", 3)
    assert "step_mape 0.120 over its limit 0.100 (and 2 more), but 0.030 with the model at the machine's measured speed " \
           "(it moved 12% from the profile)" in result.reason
    assert "rerun it, on a quieter machine" in result.reason and "accelerator" in result.reason


def test_a_miss_within_the_runs_own_spread_is_inconclusive() -> None:
    """Issue 27's run 3: TTFT p50 0.182 off, where the median request moves by a step between two measurements of the run."""
    figures = checks(ttft_p50_rel_error=0.182)
    explained = {c["name"]: c["value"] for c in figures}
    result = verdict(figures, {**spread(), "ttft_p50_rel_error": 0.15}, explained, moved=0.02, thresholds=LIMITS)
    assert result.outcome == "inconclusive"
    # the same miss with a repeatable TTFT is the model's
    assert verdict(figures, spread(0.01), explained, moved=0.02, thresholds=LIMITS).outcome == "fail"


def test_every_check_passing_while_the_machine_moved_past_the_step_limit_is_inconclusive() -> None:
    """A model 20 % slow on a machine 20 % slower than profiled predicts right: a pass would say nothing."""
    figures = checks()
    result = verdict(figures, spread(), {c["name"]: c["value"] for c in figures}, moved=0.2, thresholds=LIMITS)
    assert result.outcome == "inconclusive" and "the machine's speed moved 20% from the profile's while measuring" in result.reason


@pytest.mark.parametrize("name, value", [("decision_identity", 1.0), ("kv_pool_bytes_rel_error", 0.05)])
def test_decisions_and_memory_have_no_repeatability_allowance(name: str, value: float) -> None:
    figures = checks(**{name: value})
    result = verdict(figures, spread(0.5), {n: 0.0 for n in TIMING}, moved=0.3, thresholds=LIMITS)
    assert result.outcome == "fail" and result.reason.startswith(f"{name} {value:.3f} over its limit")


def test_thresholds_are_the_users_unchanged() -> None:
    """A stricter limit from the run's TOML is the one the verdict reads: the same figures then fail."""
    strict = Thresholds(step_mape=0.03)
    figures = checks(step_mape=0.06)
    for c in figures:
        if c["name"] == "step_mape":
            c["threshold"], c["passed"] = 0.03, False
    assert verdict(figures, spread(0.01), {c["name"]: c["value"] for c in figures}, moved=0.0, thresholds=strict).outcome == "fail"
    assert Thresholds() == Thresholds(step_mape=0.10, ttft_p50=0.10, tpot_p50=0.10, e2e_p50=0.25, throughput=0.25, kv_pool_bytes=0.01)
