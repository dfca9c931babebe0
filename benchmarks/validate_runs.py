"""Issues 13 and 27's acceptance procedure: `kvsim validate` N times, optionally beside busy loops, one table.

    python benchmarks/validate_runs.py --runs 5 --out runs/accept [--busy-loops 2] [-- VALIDATE ARGS]
    python benchmarks/validate_runs.py --runs 10 --out runs/verdict --fresh-rounds 5 \
        --variant right= --variant bias=--perturb-profile=1.2 --variant norow=--no-row-count-terms -- --backend cuda

With ``--variant NAME=ARGS`` (repeatable) each round runs every variant once, in turn, so that a
machine's drift falls on all of them alike; ``--fresh-rounds K`` empties the profile cache before
the first K rounds (a newcomer's first run: the round's first variant measures the profile the
others then use); ``--deadline-s`` starts no run past that many seconds (a lent machine's budget).
Every run uses one profile cache (``--cache``, default ``<out>/cache``, as a user who runs the
command again would have), writes ``<out>/<label>N`` and its log beside it, and the table gives
the verdict and exit status, each timing check's figure beside its real-vs-real spread, the
per-step error with the model at the machine's measured speed, the machine's speed before and
after the run (reference steps over their time when profiled), how many profiles the run
measured, the steps compared (all must be identical), the wall time and the load average before
and after. ``--busy-loops K`` keeps K ``while True: pass`` processes running for the whole set,
the issue's "loaded" condition. Thresholds and verdicts are validate's own; nothing here judges a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHECKS = ("step_mape", "step_class_median_error", "ttft_p50_rel_error", "tpot_p50_rel_error", "e2e_p50_rel_error", "throughput_rel_error")
HEADER = ("run", "exit", "verdict", "step MAPE / spread", "step class / spread", "TTFT p50 / spread", "TPOT p50 / spread",
          "e2e p50 / spread", "throughput / spread", "step MAPE at machine speed", "speed before / after", "profiles measured",
          "steps (identical)", "wall", "load before-after")


def run_once(out: Path, label: str, cache: Path, extra: list[str]) -> str:
    """One `kvsim validate`; its row of the table."""
    run_dir, log = out / label, out / f"{label}.log"
    load_before, started = os.getloadavg()[0], time.perf_counter()
    with log.open("w") as sink:
        status = subprocess.run(["kvsim", "validate", "--out", str(run_dir), *extra], stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "KVSIM_CACHE": str(cache)}).returncode
    wall, load_after = time.perf_counter() - started, os.getloadavg()[0]
    result_path = run_dir / "validation.json"
    if not result_path.exists():
        return f"| {label} | {status} | no validation.json: see {log} |"
    result = json.loads(result_path.read_text())
    checks = {c["name"]: c["value"] for c in result["checks"]}
    identity, again = result["decision_identity"], result["repeatability"]
    spread, speed = again["spread"], again["machine_speed"]
    cells = [label, str(status), result["verdict"]["outcome"],
             *(f"{checks[name]:.3f} / {spread[name]:.3f}" if name in checks else "n/a" for name in CHECKS),
             f"{again['errors_at_machine_speed']['step_mape']:.3f}", f"{speed['before']:.2f} / {speed['after']:.2f}",
             str(log.read_text(errors="replace").count("profiled in ")),
             f"{identity['steps_compared']} ({'yes' if identity['identical'] else 'NO'})", f"{wall:.0f} s",
             f"{load_before:.2f}-{load_after:.2f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, help="Profile cache shared by the runs (default: <out>/cache).")
    parser.add_argument("--busy-loops", type=int, default=0, help="Busy Python loops kept running beside the runs.")
    parser.add_argument("--label", default=None, help="Run name prefix (default: quiet or loaded).")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="A run kind: its name and its own validate arguments; rounds run each in turn.")
    parser.add_argument("--fresh-rounds", type=int, default=0, help="Rounds that start with an empty profile cache.")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="Start no run after this many seconds (0: none).")
    parser.add_argument("validate_args", nargs=argparse.REMAINDER, help="After --: passed to kvsim validate.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache or args.out / "cache"
    label = args.label or ("loaded" if args.busy_loops else "quiet")
    common = [a for a in args.validate_args if a != "--"]
    variants = [(f"{label}-{name}", shlex.split(own)) for name, _, own in (v.partition("=") for v in args.variant)]
    variants = variants or [(label, [])]
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_loops)]
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER), flush=True)
    started = time.perf_counter()
    try:
        for round_index in range(args.runs):
            if round_index < args.fresh_rounds:
                shutil.rmtree(cache, ignore_errors=True)
            for name, own in variants:
                if args.deadline_s and time.perf_counter() - started > args.deadline_s:
                    break
                print(run_once(args.out, f"{name}{round_index + 1}", cache, [*common, *own]), flush=True)
    finally:
        for loop in loops:
            loop.kill()


if __name__ == "__main__":
    main()
