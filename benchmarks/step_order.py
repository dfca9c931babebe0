"""Does a step run slower right after a step of another shape? Each target shape timed after
itself and after each other shape, alternating, as a serving run alternates a lone prefill with
the decodes of its request.

    python benchmarks/step_order.py [--backend cuda] [--model small] [--steps 40] [--json OUT]

Why: on an H200 the small model's prefill steps in a validate run took 1.04-1.12x their
prediction in every run, whether they followed idle time or another prefill, while the 256-token
reference prefill, timed back to back with itself, read 0.88-0.93x; and the first decode after a
prefill read 6-12 % above the run's decode median (docs/benchmarks.md, round 3's eighteenth
session). With CUDA graphs each prefill length replays its own captured graph, so a step that
follows another shape replays a graph the GPU did not run last. This times that case apart: for
each (before, target) pair, the target's median and 10th/90th percentile on the backend's clock,
the step before it run and not timed.

Measured on an H200 (round 3's nineteenth session), the lead does not hold: with graphs the
256-token prefill took 1.128-1.136 ms after each shape and the decode 0.584-0.589 ms; eagerly,
a decode after a prefill took 1.70 ms against 1.63 ms after a decode.
"""

from __future__ import annotations

import json

import numpy as np
from graph_idle import step_bench_arguments  # beside this script

from kvsim.realexec.backends import get_backend
from kvsim.realexec.executor import Executor
from kvsim.realexec.profile_bench import PlanBuilder
from kvsim.realexec.profile_shapes import decode, footprint, prefill
from kvsim.sim.perf.model_spec import load_model

SHAPES = {"decode 1 x 128": decode(1, 128), "prefill 96": prefill(96), "prefill 256": prefill(256), "prefill 480": prefill(480)}
TARGETS = ("prefill 256", "decode 1 x 128")


def main() -> None:
    args = step_bench_arguments(__doc__, steps=40)
    backend = get_backend(args.backend, enforce_eager=args.enforce_eager)
    block_size = 16
    blocks = 2 * sum(footprint(shape, block_size) for shape in SHAPES.values())
    executor = Executor(load_model(args.model), backend, num_blocks=blocks, block_size=block_size, timing_repeats=1)
    builder = PlanBuilder(executor, np.random.default_rng(0))
    tables = {label: builder.pool.tables(shape, builder.rng) for label, shape in SHAPES.items()}
    for label, shape in SHAPES.items():  # warm-up, graph capture included
        for _ in range(3):
            executor.step(builder.plan(shape, tables[label]))
    rows = []
    for target in TARGETS:
        for before in SHAPES:
            times = []
            for _ in range(args.steps):
                executor.step(builder.plan(SHAPES[before], tables[before]))
                times.append(executor.step(builder.plan(SHAPES[target], tables[target])).duration_s * 1e3)
            p10, p50, p90 = np.percentile(times, [10, 50, 90])
            rows.append({"target": target, "before": before, "p10_ms": p10, "median_ms": p50, "p90_ms": p90})
            print(f"{target:<15} after {before:<15}: median {p50:.3f} ms (p10 {p10:.3f}, p90 {p90:.3f})", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
