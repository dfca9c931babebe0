"""Cross-validation of the simulator against a real run of the same trace.

Three questions, each answered from run objects and written to ``validation.json``:

1. Decisions: replaying the real run's measured step durations through the simulator must
   reproduce its decision log line for line (the engine is the same code; only ``dt`` came
   from elsewhere). The first diverging step is reported with both plans.
2. Timing: the cost model predicts each step the device ran (same plans, so errors are the
   model's alone), and a free-running simulation of the trace is compared with the real run
   on latency percentiles, throughput and makespan.
3. Memory: the memory model's KV pool and peak device memory against what was allocated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from kvsim.sim.toml_io import load_toml


@dataclass
class Thresholds:
    """Pass limits (relative errors as fractions). A ``[validation]`` table in the run's TOML overrides them."""

    step_mape: float = 0.10
    ttft_p50: float = 0.10
    tpot_p50: float = 0.10
    e2e_p50: float = 0.25
    throughput: float = 0.25
    kv_pool_bytes: float = 0.01
    kv_transfer: float = 0.10  # a P/D pair's KV transfers: |median of measured / simulated - 1|

    @classmethod
    def from_toml(cls, path: Path | None) -> Thresholds:
        if path is None:
            return cls()
        table = load_toml(path).get("validation", {})
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - allowed)
        if unknown:
            raise ValueError(f"{path}: [validation] has unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**table)


def rel_error(estimate: float | None, truth: float | None) -> float | None:
    if estimate is None or truth is None or truth == 0:
        return None
    return abs(estimate - truth) / abs(truth)


def compare_decisions(real_lines: list[str], replay_lines: list[str]) -> dict:
    for step, (real, replay) in enumerate(zip(real_lines, replay_lines)):
        if real != replay:
            return {
                "identical": False,
                "steps_compared": step + 1,
                "first_divergence": {"step": step, "real": json.loads(real), "sim": json.loads(replay)},
            }
    if len(real_lines) != len(replay_lines):
        step = min(len(real_lines), len(replay_lines))
        longer = real_lines if len(real_lines) > step else replay_lines
        side = "real" if longer is real_lines else "sim"
        return {
            "identical": False,
            "steps_compared": step,
            "first_divergence": {"step": step, side: json.loads(longer[step]), "real" if side == "sim" else "sim": None},
        }
    return {"identical": True, "steps_compared": len(real_lines), "first_divergence": None}


def _error_stats(predicted: np.ndarray, measured: np.ndarray) -> dict:
    """MAPE, the 90th percentile of |error|, the median of measured / predicted (1.1 = the model 10 % short) and
    the median signed error (predicted - measured) / measured, the MAPE's error with its sign."""
    if len(measured) == 0:
        return {"mape": None, "p90_abs_error_s": None, "median_ratio": None, "median_error": None, "steps": 0}
    abs_err = np.abs(predicted - measured)
    return {
        "mape": float(np.mean(abs_err / measured)),
        "p90_abs_error_s": float(np.percentile(abs_err, 90)),
        "median_ratio": float(np.median(measured / predicted)),
        "median_error": float(np.median((predicted - measured) / measured)),
        "steps": int(len(measured)),
    }


# Steps of one kind and batch size judged together (``step_class_median_error``): enough of them
# that their median is the model's, not one step's noise.
CLASS_MIN_STEPS = 20


def step_classes(kinds: list[str], batch_sizes: list[int]) -> list[str]:
    """Each step's class: its kind and how many sequences it ran ("decode x2")."""
    return [f"{kind} x{size}" for kind, size in zip(kinds, batch_sizes)]


def judged_classes(classes: np.ndarray) -> list[str]:
    """The classes of at least :data:`CLASS_MIN_STEPS` steps (the largest one where none has as many)."""
    labels, counts = np.unique(classes, return_counts=True)
    if not labels.size:
        return []
    enough = labels[counts >= CLASS_MIN_STEPS]
    return [str(label) for label in (enough if enough.size else labels[[np.argmax(counts)]])]


def worst_class_error(ratios: np.ndarray, classes: np.ndarray) -> float | None:
    """The largest |median ratio - 1| over the judged classes: ``ratios`` predicted / measured (the
    MAPE's error, signed: (predicted - measured) / measured, plus 1), or a timing's drift (measured
    again / measured)."""
    ratios, classes = np.asarray(ratios, dtype=float), np.asarray(classes)
    return max((abs(float(np.median(ratios[classes == label])) - 1.0) for label in judged_classes(classes)), default=None)


def step_errors(predicted: list[float], measured: list[float], kinds: list[str], batch_sizes: list[int]) -> dict:
    """Per-step error of predictions for the very steps the device ran: overall, by kind, decode steps by
    batch size, and each judged class (:func:`judged_classes`).

    The split shows a bias a run-wide MAPE hides: a model short on one batch size and long on
    another, or a machine that ran at another speed than when it was profiled (every size off alike).
    """
    p, m, k, b = np.asarray(predicted), np.asarray(measured), np.asarray(kinds), np.asarray(batch_sizes)
    out = _error_stats(p, m)
    out["by_kind"] = {kind: _error_stats(p[k == kind], m[k == kind]) for kind in ("prefill", "decode", "mixed") if np.any(k == kind)}
    decode = k == "decode"
    out["decode_by_batch_size"] = {str(n): _error_stats(p[decode & (b == n)], m[decode & (b == n)])
                                   for n in np.unique(b[decode]).tolist()}
    classes = np.asarray(step_classes(kinds, batch_sizes))
    out["by_class"] = {label: _error_stats(p[classes == label], m[classes == label]) for label in judged_classes(classes)}
    out["class_median_error"] = worst_class_error(p / m, classes) if m.size else None
    return out


def reference_ratios(speed_check: dict, baseline: str = "predicted_s") -> str:
    """Each reference step of a speed check (``SpeedCheck.to_dict``) with its measured time over ``baseline``'s
    (``predicted_s``, or ``profiled_s``: its time when the machine was profiled)."""
    return ", ".join(f"{label} {m / b:.2f}x" for label, m, b in
                     zip(speed_check["labels"], speed_check["measured_s"], speed_check[baseline]))


def latency_errors(real: dict, sim: dict) -> dict:
    out = {}
    for metric in ("ttft_s", "tpot_s", "e2e_s"):
        out[metric] = {
            q: {"real": real[metric][q], "sim": sim[metric][q], "rel_error": rel_error(sim[metric][q], real[metric][q])}
            for q in ("p50", "p99")
        }
    return out


def _pair(real: float | None, sim: float | None) -> dict:
    return {"real": real, "sim": sim, "rel_error": rel_error(sim, real)}


def check_row(name: str, value: float | None, threshold: float, group: str) -> dict:
    return {"name": name, "value": value, "threshold": threshold, "passed": value is not None and value <= threshold, "group": group}


def validate_runs(
    measured_steps: list[float],
    real_summary: dict,
    sim_summary: dict,
    decisions: dict,
    predicted_steps: list[float],
    step_kinds: list[str],
    step_batch_sizes: list[int],
    predicted_kv_pool_bytes: int,
    predicted_peak_bytes: int,
    thresholds: Thresholds,
    extra_checks: tuple[dict, ...] = (),
) -> dict:
    """Assemble ``validation.json``: every comparison, and each threshold's verdict. ``measured_steps``: the
    real run's timed steps (every engine's), in the order of ``predicted_steps``; ``extra_checks``: a
    layout's own (a P/D pair's KV transfers), between the latency checks and the memory check."""
    per_step = step_errors(predicted_steps, measured_steps, step_kinds, step_batch_sizes)
    latency = latency_errors(real_summary, sim_summary)
    measured = real_summary.get("measured", {})
    predicted_pool, predicted_peak = predicted_kv_pool_bytes, predicted_peak_bytes
    memory = {
        "kv_pool_bytes": {"predicted": predicted_pool, "measured": measured.get("kv_pool_bytes"),
                          "rel_error": rel_error(predicted_pool, measured.get("kv_pool_bytes"))},
        "peak_device_bytes": {"predicted": predicted_peak, "measured": measured.get("peak_memory_bytes"),
                              "rel_error": rel_error(predicted_peak, measured.get("peak_memory_bytes"))},
        "peak_kv_blocks_used": {"real": real_summary["peak_kv_blocks_used"], "sim": sim_summary["peak_kv_blocks_used"]},
        "preemptions": {"real": real_summary["preemptions"], "sim": sim_summary["preemptions"]},
    }
    timing = {
        "per_step": per_step,
        "latency": latency,
        "throughput_tok_s": _pair(real_summary["throughput_tok_s"], sim_summary["throughput_tok_s"]),
        "makespan_s": _pair(real_summary["duration_s"], sim_summary["duration_s"]),
    }
    t = thresholds
    checks = [
        {"name": "decision_identity", "value": 0.0 if decisions["identical"] else 1.0, "threshold": 0.0,
         "passed": decisions["identical"], "group": "decisions"},
        check_row("step_mape", per_step["mape"], t.step_mape, "timing"),
        check_row("step_class_median_error", per_step["class_median_error"], t.step_mape, "timing"),
        check_row("ttft_p50_rel_error", latency["ttft_s"]["p50"]["rel_error"], t.ttft_p50, "latency"),
        check_row("tpot_p50_rel_error", latency["tpot_s"]["p50"]["rel_error"], t.tpot_p50, "latency"),
        check_row("e2e_p50_rel_error", latency["e2e_s"]["p50"]["rel_error"], t.e2e_p50, "latency"),
        check_row("throughput_rel_error", timing["throughput_tok_s"]["rel_error"], t.throughput, "latency"),
        *extra_checks,
        check_row("kv_pool_bytes_rel_error", memory["kv_pool_bytes"]["rel_error"], t.kv_pool_bytes, "memory"),
    ]
    return {
        "passed": all(c["passed"] for c in checks),
        "checks": checks,
        "decision_identity": decisions,
        "timing": timing,
        "memory": memory,
        "thresholds": asdict(thresholds),
    }


PASS, FAIL, INCONCLUSIVE = 0, 1, 3  # exit statuses (2 stays the user's mistake)


@dataclass(frozen=True)
class Verdict:
    """``kvsim validate``'s outcome, its exit status and the one line that says why."""

    outcome: str  # pass, fail or inconclusive
    exit_code: int
    reason: str

    @property
    def line(self) -> str:
        said = {"pass": "passed", "fail": "failed"}.get(self.outcome, self.outcome)
        return f"validation {said}: {self.reason}"

    def to_dict(self) -> dict:
        return {"outcome": self.outcome, "exit_code": self.exit_code, "reason": self.reason, "line": self.line}


def allowance(check: str, threshold: float, spread: float) -> float:
    """The largest figure a model exactly at ``threshold`` could show against measurements that move by ``spread``.

    The per-step MAPE averages hundreds of steps whose model error and measurement error are
    independent: they add in quadrature. Every other figure is one number of one real run, which
    may lie ``spread`` from its repeat in either direction: the two add.
    """
    return float(np.hypot(threshold, spread)) if check == "step_mape" else threshold + spread


def noisy_profile(held_out_step_mape: float | None, step_limit: float) -> str | None:
    """Why a profile cannot carry a fail verdict (the verdict's ``profile_noise``), or None: its fit missed
    its own held-out steps, timed in the same minutes on the same machine, by more than the step limit."""
    if held_out_step_mape is None or held_out_step_mape <= step_limit:
        return None
    return f"the profile's fit missed its own held-out steps by {held_out_step_mape:.1%}, more than the step limit {step_limit:.0%}"


def _excess(miss: tuple[dict, float | None, float | None]) -> float:
    """How far a miss lies beyond its allowance, as a ratio: the verdict's line names the farthest first,
    so a run that misses several checks is not summed up by whichever the check list happens to hold first.
    A miss with no allowance (decisions, memory) or no figure outranks every timing miss."""
    _, best, room = miss
    if best is None or room is None:
        return float("inf")
    return best / room if room > 0 else float("inf")


def verdict(checks: list[dict], spread: dict[str, float | None], explained: dict[str, float | None], moved: float,
            thresholds: Thresholds, fit_ratio: float | None = None, advice: str = "rerun it",
            load_moved: str | None = None, profile_noise: str | None = None) -> Verdict:
    """Pass, fail or inconclusive from the checks and what the machine's own measured behaviour explains.

    ``spread``: each timing check's real-vs-real spread (realexec/repeatability.py); checks without
    one (decisions, memory) get no allowance: a miss there is the model's. ``explained``: each
    timing check's least error with the model scaled to the speeds the machine ran at while
    measuring, and to those times ``fit_ratio`` (where the profile's quick fit landed against the
    reference steps timed beside it: a fit the machine's noise bent; None: not recorded).
    ``advice``: what an inconclusive verdict tells the user to do (the backend's ``rerun_advice``).
    ``moved``: how far the machine's speed strayed while measuring (``MachineSpeed.moved``).
    ``load_moved``: how the CPUs other processes kept busy moved between the profile's measurement
    and the real run, where they moved by more than realexec/host_load.py's margin (None: they did not,
    or were not measured): a machine shared differently from when its profile was measured.
    ``profile_noise``: why the profile cannot carry a fail (None: it can): its fit missed its own held-out
    steps by more than the step limit, even after the measurements validate takes again
    (:func:`noisy_profile`): the machine was too noisy while it was profiled to fit a model that
    predicts its own steps, so a miss of the run's steps is as likely the profile's noise as the model's error.

    - **fail**: a check misses its threshold, and its error, even with the model at the machine's
      speed, is beyond what a model exactly at the threshold could show given the spread
      (:func:`allowance`): more than the machine's repeatability explains.
    - **inconclusive**: a check misses, but within what the machine's speed and spread explain, or
      beyond it where only timing checks miss and either the other processes' load moved between the
      profile and the run or the profile missed its own held-out steps (a decision or memory miss
      stays a fail: no machine explains it); or every check passes while the machine moved by more
      than the step threshold (a model off by as much as the machine moved would pass too).
    - **pass**: every check within its threshold, on a machine that held its profiled speed.
    Thresholds are the user's, unchanged; only the reading of a miss depends on the machine.
    """
    fit_note = (f", or {fit_ratio:.2f}x that where the profile's fit landed against its own reference steps"
                if fit_ratio not in (None, 1.0) else "")
    beyond, within = [], []
    for c in (c for c in checks if not c["passed"]):
        s, e = spread.get(c["name"]), explained.get(c["name"])
        best = None if c["value"] is None or e is None else min(c["value"], e)
        room = None if s is None else allowance(c["name"], c["threshold"], s)
        (beyond if best is None or room is None or best > room else within).append((c, best, room))
    if beyond:
        beyond.sort(key=_excess, reverse=True)
        c, best, room = beyond[0]
        value = "n/a" if c["value"] is None else f"{c['value']:.3f}"
        why = f"{c['name']} {value} over its limit {c['threshold']:.3f}"
        if best is not None and room is not None:
            why += (f", and {best:.3f} with the model at the machine's measured speed{fit_note}, beyond the {room:.3f} that a model at "
                    f"the limit could show on measurements that move as this machine's did")
        more = f" (and {len(beyond) - 1} more)" if len(beyond) > 1 else ""
        timing_only = all(spread.get(c["name"]) is not None for c, _, _ in beyond)
        if timing_only and load_moved is not None:
            return Verdict("inconclusive", INCONCLUSIVE,
                           f"{why}{more}, but other processes kept {load_moved}: the machine was not shared as it was when "
                           f"its profile was measured, so the miss may be the machine's; {advice}")
        if timing_only and profile_noise is not None:
            return Verdict("inconclusive", INCONCLUSIVE, f"{why}{more}, but {profile_noise}: the machine was too noisy "
                           f"while it was profiled to tell the model's error from the profile's; {advice}")
        return Verdict("fail", FAIL, f"{why}{more}: the model misses by more than the machine's repeatability explains")
    if within:
        c, best, room = within[0]
        more = f" (and {len(within) - 1} more)" if len(within) > 1 else ""
        return Verdict("inconclusive", INCONCLUSIVE,
                       f"{c['name']} {c['value']:.3f} over its limit {c['threshold']:.3f}{more}, but {best:.3f} with the model "
                       f"at the machine's measured speed (it moved {moved:.0%} while measuring){fit_note}, within the {room:.3f} that "
                       f"measurements moving as this machine's did allow: the machine cannot tell this model's error from its "
                       f"own; {advice}")
    if moved > thresholds.step_mape:
        return Verdict("inconclusive", INCONCLUSIVE,
                       f"every check passed, but the machine's speed moved {moved:.0%} while measuring, "
                       f"more than the step limit {thresholds.step_mape:.0%}: a model off by as much would pass too; {advice}")
    return Verdict("pass", PASS, f"every check within its limit, the machine's speed within {moved:.0%} while measuring")
