"""Saved `kvsim validate` runs judged again by this checkout's verdict, without running anything.

    python benchmarks/reread_verdict.py RUNS_DIR    # RUNS_DIR/<label>N/validation.json, as validate_runs.py writes them

Each run's own measurements are kept: its checks, real-vs-real spreads, errors at the machine's
speed, speeds before and after and retime passes. What this checkout computes differently is
recomputed from the saved step series: the class check (``step_class_median_error``) and its
error at the machine's speeds, and the machine's move with the passes in it. A run saved before
the class check had no class spread; its step MAPE spread stands in (printed as such). A re-reading
tells how today's verdict would have read those measurements; it is not a new run.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from kvsim.realexec.repeatability import MachineSpeed
from kvsim.realexec.validation import Thresholds, check_row, step_classes, verdict, worst_class_error

CLASS = "step_class_median_error"


def reread(path: Path, thresholds: Thresholds) -> tuple[str, str, bool]:
    """(the saved outcome, today's outcome and its line, whether the class spread was stood in for)."""
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
    today = verdict(checks, spread, explained, moved.moved, thresholds, fit)
    return saved["verdict"]["outcome"], today.line, stood_in


def main() -> None:
    runs = Path(sys.argv[1])
    thresholds, counts = Thresholds(), Counter()
    paths = sorted(runs.glob("*/validation.json"), key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.parent.name)])
    for path in paths:
        was, line, stood_in = reread(path, thresholds)
        outcome = line.split()[1].rstrip(":")
        counts[(re.sub(r"\d+$", "", path.parent.name), outcome)] += 1
        print(f"| {path.parent.name} | {was} | {line}{' (class spread: the MAPE spread)' if stood_in else ''} |")
    for (variant, outcome), n in sorted(counts.items()):
        print(f"{variant}: {outcome} {n}")


if __name__ == "__main__":
    main()
