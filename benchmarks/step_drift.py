"""How far one step's time drifts over minutes on this CPU: the tiny model against wider variants of it.

Every round times the same steps (decode 1 x 128, decode 4 x 256, prefill 256) of every model,
each the median of five primed runs as ``kvsim validate``'s speed check takes it, on the cpu
backend's clock (thread CPU time); rounds repeat for ``--seconds``, the models interleaved so that
each sees the same moments of the machine. Per case: the median over rounds, the 5th-95th
percentile of the rounds' medians over it, and their mean |round / median - 1| (the drift a
profile measured minutes earlier meets).

    python benchmarks/step_drift.py [--seconds 150] [--variant 512x4 --variant 768x2 ...]

A variant ``HIDDENxLAYERS`` is the tiny model widened: head_dim 64, hidden/64 query heads,
hidden/128 KV heads, an intermediate size of 11/4 of the hidden size (a multiple of 16).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from kvsim.realexec.backends import get_backend
from kvsim.realexec.executor import Executor
from kvsim.realexec.profile_bench import OperatorBenches, measure
from kvsim.realexec.profile_shapes import decode, footprint, prefill
from kvsim.realexec.speed_check import REPEATS
from kvsim.sim.perf.model_spec import ModelSpec, load_model

SHAPES = (("decode 1 x 128", decode(1, 128)), ("decode 4 x 256", decode(4, 256)), ("prefill 256", prefill(256)))
BLOCK_SIZE = 16


def widened(variant: str) -> ModelSpec:
    """The tiny model at ``HIDDENxLAYERS``."""
    hidden, layers = (int(x) for x in variant.split("x"))
    return replace(load_model("tiny"), name=f"tiny-{variant}", hidden_size=hidden, num_layers=layers, head_dim=64,
                   num_heads=hidden // 64, num_kv_heads=hidden // 128, intermediate_size=hidden * 11 // 4 // 16 * 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--variant", action="append", default=None, help="HIDDENxLAYERS (default: 512x4 768x2)")
    args = parser.parse_args()
    backend = get_backend("cpu")
    blocks = 2 * max(footprint(shape, BLOCK_SIZE) for _, shape in SHAPES)
    cases = []
    for spec in [load_model("tiny"), *(widened(v) for v in args.variant or ("512x4", "768x2"))]:
        executor = Executor(spec, backend, num_blocks=blocks, block_size=BLOCK_SIZE, seed=0, kv_dtype=spec.kv_dtype)
        rng = np.random.default_rng(0)
        benches = OperatorBenches(executor, rng, 0)
        cases += [(f"{spec.name}: {label}", benches.step(shape), rng) for label, shape in SHAPES]
    rounds, start = [], time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        rounds.append([float(measure([sample], REPEATS, rng).median[0]) for _, sample, rng in cases])
    times = np.array(rounds)
    medians = np.median(times, axis=0)
    ratios = times / medians
    print(f"{len(rounds)} rounds in {time.perf_counter() - start:.0f} s on {backend.clock}")
    print("| case | median (ms) | rounds p5-p95 / median | mean abs(round / median - 1) |")
    print("|---|---|---|---|")
    for j, (name, _, _) in enumerate(cases):
        low, high = np.percentile(ratios[:, j], [5, 95])
        print(f"| {name} | {1e3 * medians[j]:.2f} | {low:.3f}-{high:.3f} | {np.mean(np.abs(ratios[:, j] - 1)):.3f} |")


if __name__ == "__main__":
    main()
