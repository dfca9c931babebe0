"""How the cpu backend's device clock behaves: the same step timed on CPU time and wall time, and
small-batch GEMM costs.

1. The speed check's three reference steps of the tiny model (decode 1 x 128, decode 8 x 256,
   prefill 256) and decode steps of 2-4 sequences, each timed ``--repeats`` times right after
   an untimed run of itself (as ``kvsim profile`` times steps), on the backend's clock (thread
   CPU time) and on the wall clock around it: the median and the noise (mean |run / median - 1|).
2. The tiny model's largest GEMM (gate_up, 256 -> 1,376, fp32, one thread) at 1-16 rows: the
   median CPU time of ``x @ W.T``. On MKL it is not monotonic in the rows (2-3 rows cost more
   than 4), which a roofline cannot express.
3. ``--copies S``: nine copies of one decode 1 x 128 step (three executors, each with its own
   weights and KV cache, three cases each) timed round-robin for S seconds, each copy's
   median: whether the same step costs the same wherever it falls in the work (``--reverse``:
   the round in the opposite order).

    python benchmarks/cpu_clock.py [--repeats 200] [--copies 15 [--reverse]]
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
from kvsim.realexec.speed_check import REFERENCE_SHAPES
from kvsim.sim.perf.model_spec import load_model

GEMM_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)


def noise(x: np.ndarray) -> float:
    return float(np.mean(np.abs(x / np.median(x) - 1.0)))


def step_clocks(repeats: int) -> None:
    backend = get_backend("cpu")
    executor = Executor(load_model("tiny"), backend, num_blocks=512, block_size=16, seed=0)
    benches = OperatorBenches(executor, np.random.default_rng(0), 0)
    print(f"{'step':<16}{'cpu median':>12}{'cpu noise':>11}{'wall median':>13}{'wall noise':>12}   ({backend.clock})")
    small_batches = [(f"decode {b} x 128", decode(b, 128)) for b in (2, 3, 4)]
    for label, shape in [*REFERENCE_SHAPES, *small_batches]:
        sample = benches.step(shape)
        cpu, wall = np.empty(repeats), np.empty(repeats)
        for i in range(repeats):
            run = sample.case()
            run()
            start = time.perf_counter()
            cpu[i] = run()
            wall[i] = time.perf_counter() - start
        print(f"{label:<16}{np.median(cpu) * 1e3:>10.2f}ms{noise(cpu):>11.1%}{np.median(wall) * 1e3:>11.2f}ms{noise(wall):>12.1%}")


def small_gemms(repeats: int) -> None:
    spec = load_model("tiny")
    weight = torch.randn(2 * spec.intermediate_size, spec.hidden_size)
    print(f"gate_up GEMM ({spec.hidden_size} -> {2 * spec.intermediate_size}), median CPU time by rows:")
    for rows in GEMM_ROWS:
        x = torch.randn(rows, spec.hidden_size)
        times = np.empty(repeats)
        for i in range(repeats):
            start = time.thread_time()
            x @ weight.T
            times[i] = time.thread_time() - start
        print(f"  {rows:>2} rows {np.median(times) * 1e6:7.1f} us")


def step_copies(seconds: float, reverse: bool, executors: int = 3, cases: int = 3) -> None:
    backend = get_backend("cpu")
    runs = {}
    for e in range(executors):
        executor = Executor(load_model("tiny"), backend, num_blocks=512, block_size=16, seed=e)
        benches = OperatorBenches(executor, np.random.default_rng(e), 0)
        for c in range(cases):
            runs[(e, c)] = benches.step(decode(1, 128)).case()
    for run in runs.values():
        run()
    times: dict[tuple[int, int], list[float]] = {key: [] for key in runs}
    order = list(runs.items())[::-1] if reverse else list(runs.items())
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for key, run in order:
            times[key].append(run())
    print(f"decode 1 x 128, {executors} executors x {cases} cases, round-robin{' reversed' if reverse else ''} "
          f"for {seconds:g} s ({backend.clock}):")
    for (e, c), values in times.items():
        print(f"  executor {e} case {c}: median {np.median(values) * 1e3:.3f} ms over {len(values)} runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--copies", type=float, default=0.0, metavar="SECONDS",
                        help="also time copies of one decode step round-robin for this long")
    parser.add_argument("--reverse", action="store_true", help="with --copies: the round in reverse order")
    args = parser.parse_args()
    step_clocks(args.repeats)
    small_gemms(args.repeats)
    if args.copies:
        step_copies(args.copies, args.reverse)


if __name__ == "__main__":
    main()
