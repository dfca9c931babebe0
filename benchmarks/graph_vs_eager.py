"""Steps of two `kvsim execute` runs of one trace, eager against graphs: where a step's time goes.

    python benchmarks/graph_vs_eager.py RUN_EAGER RUN_GRAPHS

Per step kind (prefill, decode, mixed): the median step time on the device clock (CUDA events:
for an eager step, kernels plus the gaps where the GPU waited for the host to launch the next
one), the median host time building the step's inputs, and the median wall-clock time of the step
as it ran once. Their ratio says how much of an eager step was the host launching kernels.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from statistics import median


def per_kind(run: Path) -> dict[str, dict[str, float]]:
    walls = json.loads((run / "summary.json").read_text())["measured"]["step_wall_s"]
    rows = [r for r in csv.DictReader((run / "steps.csv").open()) if r["timed"] == "1"]
    kinds: dict[str, dict[str, list[float]]] = {}
    for row, wall in zip(rows, walls):
        figures = kinds.setdefault(row["kind"], {"device_ms": [], "host_ms": [], "wall_ms": []})
        figures["device_ms"].append(1e3 * float(row["device_s"]))
        figures["host_ms"].append(1e3 * float(row["host_s"]))
        figures["wall_ms"].append(1e3 * wall)
    return {kind: {name: median(values) for name, values in figures.items()} | {"steps": len(figures["wall_ms"])}
            for kind, figures in kinds.items()}


def main() -> None:
    eager, graphs = per_kind(Path(sys.argv[1])), per_kind(Path(sys.argv[2]))
    print("| kind | steps | eager device ms | graphs device ms | eager wall ms | graphs wall ms | host ms (eager, graphs) |")
    print("|---|---|---|---|---|---|---|")
    for kind in sorted(set(eager) & set(graphs)):
        e, g = eager[kind], graphs[kind]
        print(f"| {kind} | {e['steps']:.0f} | {e['device_ms']:.3f} | {g['device_ms']:.3f} | {e['wall_ms']:.3f} | "
              f"{g['wall_ms']:.3f} | {e['host_ms']:.3f}, {g['host_ms']:.3f} |")


if __name__ == "__main__":
    main()
