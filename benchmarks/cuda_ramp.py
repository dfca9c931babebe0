"""How a launch-bound step's time moves in its first seconds on a GPU: the tiny model's decode 1 x 128 on cuda.

The step (one sequence, 128 tokens of context) runs back to back for ``--seconds``, then the
process sleeps ``--idle`` seconds and runs it again; per second of each phase: the SM clock
(``torch.cuda.clock_rate``, through NVML) and the median step time on device events. The tiny
model's step is some two hundred small kernels, so its device-event time is mostly the host
launching them: it follows the host's speed, not the GPU's clocks.

    python benchmarks/cuda_ramp.py [--seconds 8] [--idle 8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvsim.realexec.backends import get_backend
from kvsim.realexec.executor import Executor
from kvsim.realexec.profile_bench import OperatorBenches
from kvsim.realexec.profile_shapes import decode
from kvsim.sim.perf.model_spec import load_model


def phase(name: str, run, seconds: float) -> None:
    """Run back to back for ``seconds``; print each second's SM clock (at its first run) and median step time."""
    start, clocks, times = time.perf_counter(), {}, {}
    while (elapsed := time.perf_counter() - start) < seconds:
        second = int(elapsed)
        clocks.setdefault(second, torch.cuda.clock_rate())
        times.setdefault(second, []).append(run())
    for second, runs in times.items():
        print(f"| {name} | {second} | {clocks[second]} | {len(runs)} | {1e3 * np.median(runs):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--idle", type=float, default=8.0)
    args = parser.parse_args()
    spec = load_model("tiny")
    executor = Executor(spec, get_backend("cuda"), num_blocks=64, block_size=16, seed=0, kv_dtype=spec.kv_dtype)
    run = OperatorBenches(executor, np.random.default_rng(0), 0).step(decode(1, 128)).case()
    print("| phase | second | SM clock (MHz) | steps | median step (ms) |")
    print("|---|---|---|---|---|")
    phase("from start", run, args.seconds)
    time.sleep(args.idle)
    phase(f"after {args.idle:g} s idle", run, args.seconds / 2)


if __name__ == "__main__":
    main()
