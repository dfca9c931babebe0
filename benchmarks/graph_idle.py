"""Does a small step run slower on a GPU after the host has kept it idle? One step shape, timed
back to back and after host pauses of given lengths, as a serving loop's scheduler pauses it.

    python benchmarks/graph_idle.py [--backend cuda] [--model small] [--steps 60] [--json OUT]

For each decode shape and pause: the median and the 10th/90th percentile of the step's time on
the backend's clock (CUDA events), each step a fresh plan of one shape on the same block table
(as consecutive decode steps of one request read the same blocks). The pause is a busy wait on
the host after the plan is built, so the GPU idles for it and nothing else changes.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvsim.realexec.backends import get_backend
from kvsim.realexec.executor import Executor
from kvsim.realexec.profile_bench import PlanBuilder
from kvsim.realexec.profile_shapes import decode, footprint
from kvsim.sim.perf.model_spec import load_model

PAUSES_MS = (0.0, 0.2, 1.0, 3.0, 10.0)
CONTEXTS = (128, 384)


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def step_bench_arguments(doc: str, steps: int) -> argparse.Namespace:
    """The options of a benchmark that times one step shape on a backend (this one and step_order.py)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", dest="json_out")
    return parser.parse_args()


def main() -> None:
    args = step_bench_arguments(__doc__, steps=60)
    backend = get_backend(args.backend, enforce_eager=args.enforce_eager)
    spec = load_model(args.model)
    block_size = 16
    blocks = 2 * max(footprint(decode(1, c), block_size) for c in CONTEXTS)
    executor = Executor(spec, backend, num_blocks=blocks, block_size=block_size, timing_repeats=1)
    builder = PlanBuilder(executor, np.random.default_rng(0))
    rows = []
    for context in CONTEXTS:
        shape = decode(1, context)
        tables = builder.pool.tables(shape, builder.rng)
        for _ in range(5):  # warm-up, graph capture included
            executor.step(builder.plan(shape, tables))
        for pause_ms in PAUSES_MS:
            times = []
            for _ in range(args.steps):
                plan = builder.plan(shape, tables)
                busy_wait(pause_ms / 1e3)
                times.append(executor.step(plan).duration_s * 1e3)
            p10, p50, p90 = np.percentile(times, [10, 50, 90])
            rows.append({"context": context, "pause_ms": pause_ms, "p10_ms": p10, "median_ms": p50, "p90_ms": p90})
            print(f"decode 1 x {context:<4} pause {pause_ms:5.1f} ms: median {p50:.3f} ms (p10 {p10:.3f}, p90 {p90:.3f})",
                  flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
