"""Where a validate run's prefill steps miss: measured over predicted, split by what a step holds.

    python benchmarks/prefill_split.py RUN_DIR [RUN_DIR ...] [--capture-sizes-from h200] [--walk-block-s S]

For the prefill steps of each run (its validation.json's step series, its real run's decision
log): the median measured / predicted of the steps that replayed a capture size for the first
time in the run and of those that replayed one again; and by new tokens and by context (cached
plus new tokens). Why: on an H200 every right run's prefills took 1.04-1.12x their prediction
while a 256-token prefill with no cached prefix read 0.88-0.93x (docs/benchmarks.md, round 3's
eighteenth and nineteenth sessions); this tells a first launch from a shape the model prices
wrong. ``--walk-block-s`` adds a column: the ratio had each prefill step also paid, at that many
seconds a block a layer (a profile's ``decode_chain`` ``block_s``), the part of its longest prefill
entry's block walk beyond its longest decode entry's: what the cost model left out before its
``prefill_chain`` term (profiler version 13), so a column for runs predicted before it; a later run's
prediction prices that walk already, at its profile's own cost.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvsim.policies.plan import StepPlan
from kvsim.sim.perf.device import load_device
from kvsim.sim.perf.engine_overhead import EngineProfile
from kvsim.sim.perf.model_spec import load_model
from kvsim.sim.run.decisions import read_decisions

TOKEN_BUCKETS = ((1, 64), (64, 256), (256, 512), (512, 513), (513, None))
CONTEXT_BUCKETS = ((0, 256), (256, 512), (512, 1024), (1024, None))


def prefill_steps(run_dir: Path, engine: EngineProfile, walk_block_s: float) -> list[dict]:
    """Each prefill step's new tokens, context, whether its capture size was new, measured / predicted, and that
    ratio with the prefill walk the cost model leaves out priced at ``walk_block_s`` (module docstring)."""
    validation = json.loads((run_dir / "validation.json").read_text())
    series = validation["series"]["step_time"]
    layers = load_model(validation["config"]["model"]).num_layers
    block_size = validation["config"]["block_size"]
    seen: set[float] = set()
    steps = []
    for index, line in enumerate(read_decisions(run_dir / "real")):
        plan = StepPlan.from_dict(json.loads(line))
        size = engine.padded_tokens(plan.num_tokens) if engine.in_graph(plan.num_tokens) else None
        first = size is not None and size not in seen
        if size is not None:
            seen.add(size)
        if series["kind"][index] == "prefill":
            totals = plan.totals_for(block_size)
            unpriced_walk_s = layers * max(0, totals.prefill_max_blocks - totals.decode_max_blocks) * walk_block_s
            measured, predicted = series["measured"][index], series["predicted"][index]
            steps.append({"tokens": plan.num_tokens, "context": max(e.end_position for e in plan.entries), "first_size": first,
                          "ratio": measured / predicted, "walk_ratio": measured / (predicted + unpriced_walk_s)})
    return steps


def line(label: str, steps: list[dict], keep: Callable[[dict], bool], walk: bool) -> str:
    kept = [s for s in steps if keep(s)]
    if not kept:
        return f"{label:<34} none"
    p10, p50, p90 = np.percentile([s["ratio"] for s in kept], [10, 50, 90])
    text = f"{label:<34} {len(kept):5d} steps  median {p50:.3f}  (p10 {p10:.3f}, p90 {p90:.3f})"
    return text + (f"  walk priced: median {np.median([s['walk_ratio'] for s in kept]):.3f}" if walk else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--capture-sizes-from", default="h200", help="Device file whose [engine] capture_sizes the executor used.")
    parser.add_argument("--walk-block-s", type=float, default=0.0,
                        help="Seconds a block a layer to price the prefill walk at (module docstring); 0: no such column.")
    args = parser.parse_args()
    engine = load_device(args.capture_sizes_from).engine
    steps = [step for run in args.runs for step in prefill_steps(run, engine, args.walk_block_s)]
    walk = args.walk_block_s > 0
    print(line("all prefill steps", steps, lambda s: True, walk))
    print(line("first replay of a capture size", steps, lambda s: s["first_size"], walk))
    print(line("a capture size replayed again", steps, lambda s: not s["first_size"], walk))
    for key, buckets in (("tokens", TOKEN_BUCKETS), ("context", CONTEXT_BUCKETS)):
        for low, high in buckets:
            label = f"{'new tokens' if key == 'tokens' else key} {low}{'+' if high is None else f'-{high - 1}'}"
            print(line(label, steps, lambda s, k=key, lo=low, hi=high: lo <= s[k] and (hi is None or s[k] < hi), walk))


if __name__ == "__main__":
    main()
