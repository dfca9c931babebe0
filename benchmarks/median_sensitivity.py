"""How far the latency medians of `kvsim validate`'s workload move when every step shifts a little, by load.

    python benchmarks/median_sensitivity.py --profile PROFILE.toml [--model small] [--rate-scale 1]
        [--num-blocks 56] [--loads 0.25:2:0.125]

The workload is validate's default (the demo trace) with the given rate and pool, simulated with
PROFILE's cost model at each load (every operator time times the load: a machine that much slower,
or traffic that much heavier) and again with every step shifted by -4, -2, +2 and +4 %. A median
that follows its steps moves by the shift; the table gives each median's largest move beyond it
(0.14: the TTFT median moved 14 % more than its steps). That is how far a right model's latency
checks can miss on a machine whose speed wanders by a few per cent (docs/validate-verdict.md).
"""

from __future__ import annotations

import argparse

import numpy as np

from kvsim.cli.execute import REAL_DEFAULTS
from kvsim.realexec.repeatability import at_machine_speed
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import load_run_trace, resolve
from kvsim.sim.run.simulator import SimOptions, simulate

SHIFTS = (0.96, 0.98, 1.02, 1.04)
MEDIANS = ("ttft_s", "tpot_s", "e2e_s")


def loads(spec: str) -> np.ndarray:
    start, stop, step = (float(x) for x in spec.split(":"))
    return np.arange(start, stop + step / 2, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="A calibrated device profile (kvsim profile, or validate's cache).")
    parser.add_argument("--model", default=REAL_DEFAULTS.model)
    parser.add_argument("--rate-scale", type=float, default=REAL_DEFAULTS.rate_scale)
    parser.add_argument("--num-blocks", type=int, default=REAL_DEFAULTS.num_blocks)
    parser.add_argument("--loads", default="0.25:2:0.125", help="START:STOP:STEP")
    args = parser.parse_args()
    config = REAL_DEFAULTS.updated(device=args.profile, model=args.model, rate_scale=args.rate_scale, num_blocks=args.num_blocks)
    resolved, trace = resolve(config), load_run_trace(config)

    def summary(speed: float) -> dict:
        scaled = at_machine_speed(resolved, speed)
        return simulate(trace, scaled.new_engine(), CostModelTimer(scaled.cost_model()), SimOptions()).summary()

    print(f"{args.model}, rate x{args.rate_scale:g}, {args.num_blocks} blocks: each median's largest move beyond a shift of "
          f"every step by {', '.join(f'{s - 1:+.0%}' for s in SHIFTS)}")
    print("| load | TTFT p50 | TPOT p50 | e2e p50 | preemptions |")
    print("|---|---|---|---|---|")
    for load in loads(args.loads):
        base, shifted = summary(load), {s: summary(load * s) for s in SHIFTS}
        moves = [max(abs(shifted[s][key]["p50"] / base[key]["p50"] / s - 1) for s in SHIFTS) for key in MEDIANS]
        print(f"| {load:.3f} | " + " | ".join(f"{m:.3f}" for m in moves) + f" | {base['preemptions']} |", flush=True)


if __name__ == "__main__":
    main()
