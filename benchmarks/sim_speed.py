"""Simulator speed on whole real traces (run by hand; results go to docs/benchmarks.md).

    python benchmarks/sim_speed.py [--repeats 3] [--profile] [--decisions off|summary|full]
    python benchmarks/sim_speed.py --steady 8 256 [--steady-steps 4000]

Azure conv (19,366 requests) and Mooncake conversation (12,031 requests, prompts up to 126k
tokens) with Llama-2-7B-shaped and Qwen2.5-7B-shaped models on a 910B profile, fcfs + paged.
Reports the median wall time of the simulation (trace loaded; with ``--decisions`` summary or
full, the decision log is kept as ``kvsim simulate`` keeps it, in the simulation's time) and of
writing requests.csv and steps.csv, over ``--repeats`` runs, in a single process.

``--steady N ...`` instead runs, for each N, a batch that stays at N sequences (issue 14 asks
for steps per second within 2x between 8 and 256): N requests arriving at 0 that decode
together for ``--steady-steps`` tokens, ``max_num_seqs`` N and blocks enough that none is
preempted; it reports steps per second.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvsim import traces
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import RunConfig, resolve
from kvsim.sim.run.decisions import DecisionLog
from kvsim.sim.run.outputs import write_requests, write_steps
from kvsim.sim.run.simulator import SimOptions, simulate

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
CASES = {
    "azure_conv": (SHARED / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv",
                   RunConfig(model="llama-2-7b", device="ascend-910b3", scheduler="fcfs", block_manager="paged")),
    "mooncake_conv": (SHARED / "mooncake_fast25" / "conversation_trace.jsonl",
                      RunConfig(model="qwen2.5-7b", device="ascend-910b3", scheduler="fcfs", block_manager="paged",
                                max_model_len=131072)),
}


STEADY_PROMPT = 32  # tokens: the prefill is over in a few steps and the rest is decode


def steady_batch(n: int, steps: int) -> tuple[traces.Trace, RunConfig]:
    """``n`` requests at time 0 that decode side by side for ``steps`` tokens each, never preempted."""
    config = RunConfig(model="llama-2-7b", device="ascend-910b3", scheduler="fcfs", block_manager="paged",
                       max_num_seqs=n)
    blocks_each = -(-(STEADY_PROMPT + steps) // config.block_size)
    trace = traces.Trace(arrival_s=np.zeros(n), prompt_tokens=np.full(n, STEADY_PROMPT, dtype=np.int64),
                         output_tokens=np.full(n, steps, dtype=np.int64), source=f"steady batch of {n}")
    return trace, config.updated(num_blocks=n * blocks_each)


def run_steady(sizes: list[int], steps: int, repeats: int, decisions: str) -> None:
    for n in sizes:
        trace, config = steady_batch(n, steps)
        results = [run_once(trace, config, decisions) for _ in range(repeats)]
        summary = results[0][0].summary()
        if summary["preemptions"] or summary["requests_completed"] != n:
            raise SystemExit(f"steady batch of {n} was not steady: {summary['preemptions']} preemptions, "
                             f"{summary['requests_completed']} of {n} completed")
        sims = [s for _, s, _ in results]
        wall = statistics.median(sims)
        print(f"steady batch {n}: {summary['steps']} steps, "
              f"wall median {wall:.3f} s (runs: {', '.join(f'{s:.3f}' for s in sims)}), "
              f"{summary['steps'] / wall:,.0f} steps/s, {n * steps / wall:,.0f} request-steps/s")


def run_once(trace, config: RunConfig, decisions: str = "off"):
    resolved = resolve(config)
    timer = CostModelTimer(resolved.cost_model())
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        log = None if decisions == "off" else DecisionLog(decisions, resolved.engine_config.block_size, Path(tmp))
        run = simulate(trace, resolved.new_engine(), timer, SimOptions(decisions=log))
        if log is not None:
            log.close()
        sim_s = time.perf_counter() - started
        started = time.perf_counter()
        write_requests(Path(tmp), run.records.requests)
        write_steps(Path(tmp), run.steps)
        write_s = time.perf_counter() - started
    return run, sim_s, write_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile one run of each case")
    parser.add_argument("--decisions", choices=("off", "summary", "full"), default="off", help="decision log kept")
    parser.add_argument("--steady", type=int, nargs="+", metavar="N", help="steady decode batches of N sequences")
    parser.add_argument("--steady-steps", type=int, default=4000,
                        help="tokens each sequence of a steady batch decodes (longer runs are less noisy)")
    args = parser.parse_args()
    if args.steady:
        run_steady(args.steady, args.steady_steps, args.repeats, args.decisions)
        return
    for name, (path, config) in CASES.items():
        if not path.exists():
            print(f"{name}: {path} not found, skipped")
            continue
        trace = traces.load(path)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            run_once(trace, config, args.decisions)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
            continue
        results = [run_once(trace, config, args.decisions) for _ in range(args.repeats)]
        run = results[0][0]
        summary = run.summary()
        sims = [s for _, s, _ in results]
        writes = [w for _, _, w in results]
        print(
            f"{name}: {len(trace)} requests, {summary['steps']} steps, "
            f"{summary['requests_completed']} completed, {summary['requests_rejected']} rejected, "
            f"simulated {summary['duration_s']:.0f} s; wall median {statistics.median(sims):.2f} s "
            f"(runs: {', '.join(f'{s:.2f}' for s in sims)}), files {statistics.median(writes):.2f} s"
        )


if __name__ == "__main__":
    main()
