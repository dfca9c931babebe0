"""How far validate's speed check moves when nothing changes: the reference steps timed again and again.

    python benchmarks/speed_check_spread.py --backend cuda --model small --checks 8 --setting 5 --setting 5@1 --setting 21 --setting 5x3

A setting is ``ROUNDS[xEXECUTORS][@IDLE_S]``: the reference steps timed as ``kvsim validate``'s
speed check times them (``speed_check.reference_times``: every step primed, the median of ROUNDS
interleaved rounds, then each step's median over EXECUTORS fresh executors built one after
another; 1 unless given), after IDLE_S seconds of the device doing nothing (a GPU's clocks fall
when it idles). The settings take turns, check by check, so that the machine's drift meets them
alike. Printed per setting: each check's reading (the median over the three steps of time / that
step's median over every check of the setting), and the largest |reading - 1|: a speed check
reading further than that from 1 on this machine is not evidence that it moved.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvsim.realexec.backends import get_backend
from kvsim.realexec.speed_check import REFERENCE_LABELS, reference_times
from kvsim.sim.perf.model_spec import load_model


def parse_setting(text: str) -> tuple[int, int, float]:
    counts, _, idle = text.partition("@")
    rounds, _, executors = counts.partition("x")
    return int(rounds), int(executors or 1), float(idle or 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--model", default="small")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--checks", type=int, default=6, help="speed checks per setting")
    parser.add_argument("--setting", action="append", type=parse_setting,
                        help="ROUNDS[xEXECUTORS][@IDLE_S] (repeatable; default 5 and 5x3)")
    args = parser.parse_args()
    settings = args.setting or [(5, 1, 0.0), (5, 3, 0.0)]
    backend, spec = get_backend(args.backend), load_model(args.model)
    times: dict[tuple[int, int, float], list[list[float]]] = {s: [] for s in settings}
    for check in range(args.checks):
        for rounds, count, idle in settings:
            backend.synchronize()
            time.sleep(idle)
            measured, _ = reference_times(backend, spec, args.block_size, spec.kv_dtype, seed=check * count,
                                          executors=count, repeats=rounds)
            times[(rounds, count, idle)].append(measured)
    print(f"{args.backend} ({backend.machine_name()}), model {args.model}, steps {', '.join(REFERENCE_LABELS)}")
    print("| rounds | executors | idle before | readings (median step time over its median over the checks) | largest move |")
    print("|---|---|---|---|---|")
    for (rounds, count, idle), rows in times.items():
        seconds = np.array(rows)
        readings = np.median(seconds / np.median(seconds, axis=0), axis=1)
        cells = " ".join(f"{r:.3f}" for r in readings)
        print(f"| {rounds} | {count} | {idle:g} s | {cells} | {np.max(np.abs(readings - 1)):.1%} |")
    print("step medians (ms): " + "; ".join(f"{label} {np.median([r[i] for rows in times.values() for r in rows]) * 1e3:.3f}"
                                            for i, label in enumerate(REFERENCE_LABELS)))


if __name__ == "__main__":
    main()
