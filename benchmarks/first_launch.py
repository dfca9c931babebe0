"""Is a captured graph's first launch slower than its later ones? For fresh prefill sizes, each
size's launches timed one by one: a graph captured bare (its first launch timed) and the
executor's own step (captured with ``realexec.graphs.capture``, which launches it once untimed).

    python benchmarks/first_launch.py [--backend cuda] [--model small] [--steps 6] [--json OUT]

Why: the executor captured a size at its first step and timed that step's replay, and the
profiler's attention and KV-write cases each timed a one-off graph's first replay. On an H200
(round 3's nineteenth session, docs/benchmarks.md) the first replay of each of 16 newly captured
prefill sizes took 0.99-1.13x its later replays (median 1.06x) on the small model and
1.00-1.14x on Llama-3.1-8B; ``realexec.graphs.capture`` now launches a graph once, untimed. For
each size: launch 1 and the median of the later launches on the backend's clock, bare (launch 1
timed) and through the executor (its first timed step should read about 1.00x); a decode step
runs between launches, as in a serving run.
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

SIZES = tuple(range(136, 512, 24))  # each its own capture size (vLLM's sizes step by 8 and 16 here)


def main() -> None:
    args = step_bench_arguments(__doc__, steps=6)
    backend = get_backend(args.backend, enforce_eager=args.enforce_eager)
    block_size = 16
    between = decode(1, 128)
    blocks = 2 * sum(footprint(prefill(n), block_size) for n in SIZES) + footprint(between, block_size)
    executor = Executor(load_model(args.model), backend, num_blocks=blocks, block_size=block_size, timing_repeats=1)
    if executor.graphs is None:
        raise SystemExit(f"the {args.backend} backend replays no graphs")
    builder = PlanBuilder(executor, np.random.default_rng(0))
    between_tables = builder.pool.tables(between, builder.rng)
    for _ in range(5):
        executor.step(builder.plan(between, between_tables))
    rows = []
    for tokens in SIZES:
        shape = prefill(tokens)
        tables = builder.pool.tables(shape, builder.rng)
        bare, stepped = [], []
        graph = None
        for _ in range(args.steps):  # a bare graph of this size, its first launch timed
            plan = builder.plan(shape, tables)
            size = executor.graphs.size_for(plan.num_tokens)
            executor.graphs.load(executor._host_inputs(plan).graph_inputs, size)
            if graph is None:
                graph = backend.new_graph(executor.graphs.pool)
                graph.capture(executor.graphs._forward(size))
            bare.append(backend.elapsed(graph.replay)[1] * 1e3)
            executor.step(builder.plan(between, between_tables))
        for _ in range(args.steps):
            stepped.append(executor.step(builder.plan(shape, tables)).device_s * 1e3)
            executor.step(builder.plan(between, between_tables))
        row = {"tokens": tokens, "bare_ms": bare, "executor_ms": stepped,
               "bare_first_over_later": bare[0] / float(np.median(bare[1:])),
               "executor_first_over_later": stepped[0] / float(np.median(stepped[1:]))}
        rows.append(row)
        print(f"prefill {tokens}: first launch / later, bare {row['bare_first_over_later']:.3f}x "
              f"(later {np.median(bare[1:]):.3f} ms); executor {row['executor_first_over_later']:.3f}x", flush=True)
    for key in ("bare_first_over_later", "executor_first_over_later"):
        print(f"median over sizes, {key.replace('_', ' ')}: {np.median([r[key] for r in rows]):.3f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
