"""Saved `kvsim validate` runs judged again by this checkout's verdict, without running anything.

    python benchmarks/reread_verdict.py RUNS_DIR [RUNS_DIR ...]   # <label>N/validation.json, as validate_runs.py writes them

Each run's own measurements are kept: its checks, real-vs-real spreads, errors at the machine's
speed, speeds before and after and retime passes. What this checkout computes differently is
recomputed from the saved step series: the class check (``step_class_median_error``) and its
error at the machine's speeds, and the machine's move with the passes in it. A run saved before
the class check had no class spread; its step MAPE spread stands in (printed as such). The
profile's held-out error (what gates a fail: ``noisy_profile``) is the run's own where it recorded one;
a run saved before that reads it from the run logs beside the directories (validate_runs.py's
``<label>N.log``): the profile the last run to measure one kept, the smallest held-out error it
printed, taking the runs of every directory given in the order they finished (give a set that
reused another's cache after it). A re-reading tells how today's verdict would have read those
measurements; it is not a new run.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from kvsim.cli.validate import shared_differently
from kvsim.realexec.repeatability import MachineSpeed
from kvsim.realexec.validation import Thresholds, check_row, noisy_profile, step_classes, verdict, worst_class_error

CLASS = "step_class_median_error"
HELD_OUT = re.compile(r"^held-out steps\s+\d+\s+([\d.]+)%", re.MULTILINE)


def reread(path: Path, thresholds: Thresholds, held_out: float | None) -> tuple[str, str, bool]:
    """(the saved outcome, today's outcome and its line, whether the class spread was stood in for); ``held_out``:
    the profile's held-out error where the run did not record it."""
    saved = json.loads(path.read_text())
    series, again = saved["series"]["step_time"], saved["repeatability"]
    measured, predicted = np.asarray(series["measured"]), np.asarray(series["predicted"])
    classes = np.asarray(step_classes(series["kind"], series["batch_size"]))
    checks = [c for c in saved["checks"] if c["name"] != CLASS]
    checks.insert(2, check_row(CLASS, worst_class_error(predicted / measured, classes), thresholds.step_mape, "timing"))
    speed = again["machine_speed"]
    moved = MachineSpeed(speed["before"], speed["after"], tuple(again["pass_speed"]))
    fit = again.get("profile_fit_ratio")
    explained = {**again["errors_at_machine_speed"],
                 CLASS: min(worst_class_error(predicted * s / measured, classes) for s in moved.speeds_at_fit(fit))}
    spread = dict(again["spread"])
    stood_in = CLASS not in spread
    spread.setdefault(CLASS, spread["step_mape"])
    held_out = again.get("profile_held_out_step_mape", held_out)
    today = verdict(checks, spread, explained, moved.moved, thresholds, fit, load_moved=shared_differently(saved.get("host_load")),
                    profile_noise=noisy_profile(held_out, thresholds.step_mape))
    return saved["verdict"]["outcome"], today.line, stood_in


def main() -> None:
    thresholds, counts, held_out = Thresholds(), Counter(), None
    paths = sorted((p for runs in sys.argv[1:] for p in Path(runs).glob("*/validation.json")), key=lambda p: p.stat().st_mtime)
    for path in paths:
        log = path.parent.with_suffix(".log")
        measured = [float(x) / 100 for x in HELD_OUT.findall(log.read_text(errors="replace"))] if log.exists() else []
        held_out = min(measured) if measured else held_out  # validate keeps the smaller of two fresh profiles
        was, line, stood_in = reread(path, thresholds, held_out)
        outcome = line.split()[1].rstrip(":")
        counts[(re.sub(r"\d+$", "", path.parent.name), outcome)] += 1
        print(f"| {path.parent.name} | {was} | {line}{' (class spread: the MAPE spread)' if stood_in else ''} |")
    for (variant, outcome), n in sorted(counts.items()):
        print(f"{variant}: {outcome} {n}")


if __name__ == "__main__":
    main()
