"""Small trace samples shipped inside the package (``traces/data``), and how the demo is made.

Attribution and licences: ``traces/data/README.md``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from kvsim.traces.loader import load
from kvsim.traces.schema import Trace
from kvsim.traces.transforms import clamp, scale_rate, shrink_lengths, spread_buckets, take

DATA_DIR = Path(__file__).resolve().parent / "data"

BUNDLED: dict[str, str] = {
    "azure_conv_10min": "azure_conv_10min.csv",  # Azure LLM inference 2023, conv, first 10 minutes
    "mooncake_500": "mooncake_500.jsonl",  # Mooncake FAST'25 conversation trace, first 500 requests
    "demo": "demo.jsonl",  # ~40 short requests with shared prefixes, for `kvsim validate`
}


def bundled(name: str) -> Path:
    """Path of a bundled sample by name (see :data:`BUNDLED`)."""
    if name not in BUNDLED:
        raise KeyError(f"no bundled trace {name!r}; there are {', '.join(BUNDLED)}")
    return DATA_DIR / BUNDLED[name]


def load_named(name_or_path: str | Path) -> Trace:
    """Load a trace file, or a bundled sample when no such file exists and the name is one."""
    path = Path(name_or_path)
    if not path.exists() and str(name_or_path) in BUNDLED:
        path = bundled(str(name_or_path))
    return load(path)


# The demo: short enough for a tiny model on a CPU in about a minute, yet with the prefix
# sharing of real multi-turn traffic, so a prefix cache visibly matters.
DEMO_MIN_REQUESTS = 40
DEMO_SHRINK = 16  # 512-token hash blocks become 32-token blocks
DEMO_MAX_PROMPT = 600
DEMO_MAX_OUTPUT = 48
DEMO_RATE_FACTOR = 4.0


def make_demo() -> Trace:
    """Rebuild ``demo.jsonl`` from ``mooncake_500.jsonl``.

    1. spread each ~3 s timestamp bucket evenly (no synthetic bursts);
    2. keep whole conversations: requests grouped by their first two hash ids (the shared
       system block, then the conversation's own first block), largest groups first, ties
       by first appearance, until at least ``DEMO_MIN_REQUESTS`` requests (kept in arrival order);
    3. divide lengths and the hash block by ``DEMO_SHRINK``, which keeps every request's
       block structure, then clamp prompts to ``DEMO_MAX_PROMPT`` and outputs to
       ``DEMO_MAX_OUTPUT`` tokens;
    4. compress time ``DEMO_RATE_FACTOR``-fold.
    """
    trace = spread_buckets(load(bundled("mooncake_500")))
    rows = trace.prefix_hashes.to_rows()
    groups = Counter(tuple(r[:2]) for r in rows if len(r) >= 2)
    chosen: set[tuple[int, ...]] = set()
    size = 0
    for key, members in groups.most_common():
        if members < 2 or size >= DEMO_MIN_REQUESTS:
            break
        chosen.add(key)
        size += members
    index = np.array([i for i, r in enumerate(rows) if tuple(r[:2]) in chosen], dtype=np.int64)
    trace = take(trace, index, f"{len(index)} requests of the {len(chosen)} largest conversations")
    trace = clamp(shrink_lengths(trace, DEMO_SHRINK), max_prompt=DEMO_MAX_PROMPT, max_output=DEMO_MAX_OUTPUT)
    return scale_rate(trace, DEMO_RATE_FACTOR)
