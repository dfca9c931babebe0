"""How much of a validate run's per-step error a machine-speed correction could remove at best.

    python benchmarks/drift_floor.py runs/*/validation.json

For each run's step series (measured on the device clock, predicted by the profile), the
per-step MAPE three ways: as validate reports it; with every prediction scaled by the run's
median measured / predicted (a whole-run speed factor); and scaled by that ratio's median over
the step's ``--window`` neighbours on each side, the step itself left out. The last is an oracle:
a drift correction from reference work timed during the run could track the machine no better
than the run's own steps do. What it leaves is the steps' scatter around their neighbours,
which no profile or clock correction predicts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvsim.realexec.validation import step_errors


def floors(measured: np.ndarray, predicted: np.ndarray, kinds: list[str], batch_sizes: list[int],
           window: int) -> tuple[float, float, float]:
    """Step MAPE (validate's own definition) of the predictions as they are, whole-run scaled, locally scaled."""
    ratio = measured / predicted
    local = np.array([np.median(np.concatenate([ratio[max(0, i - window):i], ratio[i + 1:i + 1 + window]]))
                      for i in range(len(ratio))])
    return tuple(step_errors(p, measured, kinds, batch_sizes)["mape"]
                 for p in (predicted, predicted * np.median(ratio), predicted * local))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("validations", nargs="+", type=Path, help="validation.json files of kvsim validate runs")
    parser.add_argument("--window", type=int, default=25, help="neighbours on each side for the local factor")
    args = parser.parse_args()
    print(f"| run | steps | step MAPE | whole-run factor | local factor (+-{args.window} steps, oracle) |")
    print("|---|---|---|---|---|")
    for path in args.validations:
        series = json.loads(path.read_text())["series"]["step_time"]
        measured, predicted = np.array(series["measured"]), np.array(series["predicted"])
        batch_sizes = series.get("batch_size") or [0] * len(measured)  # not recorded before 2026-11-25 (MAPE needs none)
        raw, whole, local = floors(measured, predicted, series["kind"], batch_sizes, args.window)
        print(f"| {path.parent.name} | {len(measured)} | {raw:.3f} | {whole:.3f} | {local:.3f} |")


if __name__ == "__main__":
    main()
