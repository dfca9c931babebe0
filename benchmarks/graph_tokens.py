"""Do steps replayed as graphs generate the tokens eager steps do? The first check of graph mode on a device.

    python benchmarks/graph_tokens.py [--backend npu] [--model tiny] [--requests 12] [--block-size 128]

One short trace (two-turn conversations over a shared system prompt, chunked prefills, decode
batches of up to eight) runs twice through the executor on the backend, eagerly (``--enforce-eager``)
and with graphs at the backend's capture sizes. Greedy decoding of one seeded model is deterministic,
so every request's tokens must agree; the run prints the sizes captured and the first
request whose tokens differ. Exit 0 when all agree, 1 otherwise. On the npu backend this checks
what the stand-in tests cannot: that the device replays the captured graphs, with their FIA tasks
re-issued per step (``realexec/backends/npu_graphs.py``), as the stand-in models it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from kvsim import traces
from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.realexec.backends import get_backend
from kvsim.realexec.executor import Executor
from kvsim.sim.perf.model_spec import load_model
from kvsim.sim.run.simulator import SimOptions, simulate


@dataclass
class Run:
    tokens: dict[str, list[int]]
    captured_sizes: list[int]
    steps: int


def run(backend_name: str, model: str, requests: int, block_size: int, enforce_eager: bool, device: str | None) -> Run:
    """The trace through the executor; a fresh backend, so each run captures its own graphs."""
    backend = get_backend(backend_name, device, enforce_eager=enforce_eager)
    spec = load_model(model)
    trace = traces.synthesize(rate=400.0, n_requests=requests, prompt=traces.Uniform(20, 90), output=traces.Uniform(6, 20),
                              system_prompt_tokens=48, turns=2, think_time_s=0.01, hash_block_size=16, seed=11)
    config = EngineConfig(num_blocks=32, block_size=block_size, max_model_len=512, max_num_batched_tokens=48,
                          max_num_seqs=8, scheduler="fcfs", block_manager="prefix",
                          batch_blocks_within_pool=backend.needs_batch_blocks_within_pool)
    engine = EngineCore(config)
    executor = Executor(spec, backend, config.num_blocks, block_size, seed=5,
                        kv_dtype="bf16" if backend.attention_dtypes else None)
    simulate(trace, engine, executor, SimOptions())
    return Run({r: executor.tokens(r) for r in engine.requests},
               executor.graphs.captured_sizes if executor.graphs is not None else [], len(executor.wall_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="npu")
    parser.add_argument("--device", default=None, help="torch device (default: the backend's)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args(argv)
    eager = run(args.backend, args.model, args.requests, args.block_size, True, args.device)
    graphs = run(args.backend, args.model, args.requests, args.block_size, False, args.device)
    print(f"{args.backend}, {args.model}: {graphs.steps} steps; graphs captured at sizes {graphs.captured_sizes}")
    differ = [r for r in eager.tokens if eager.tokens[r] != graphs.tokens[r]]
    if not graphs.captured_sizes:
        print("no step ran as a graph: the backend captured nothing")
        return 1
    if differ:
        print(f"{len(differ)} of {len(eager.tokens)} requests differ; first {differ[0]}:\n"
              f"  eager  {eager.tokens[differ[0]]}\n  graphs {graphs.tokens[differ[0]]}")
        return 1
    print(f"all {len(eager.tokens)} requests generated the same tokens with graphs as eagerly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
