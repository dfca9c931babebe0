"""What a trace looks like in numbers: size, rate, burstiness, lengths and prefix reuse."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvsim.traces.schema import Trace


@dataclass(frozen=True)
class Summary:
    """Distribution of one length column (percentiles by numpy's default linear rule)."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, values: np.ndarray) -> Summary:
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(float(values.mean()), float(p50), float(p90), float(p99), int(values.max()))


@dataclass(frozen=True)
class TraceStats:
    rows: int
    duration_s: float  # first to last arrival
    rate_rps: float | None  # 1 / mean inter-arrival time; None with one request or zero span
    interarrival_cv: float | None  # std / mean of inter-arrival gaps; 1 for Poisson, >1 bursty
    prompt_tokens: Summary
    output_tokens: Summary
    prefix_reuse_bound: float | None  # None without prefix hashes
    source: str
    notes: tuple[str, ...]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["notes"] = list(self.notes)
        return out


def stats(trace: Trace) -> TraceStats:
    gaps = np.diff(trace.arrival_s)
    duration = float(trace.arrival_s[-1] - trace.arrival_s[0])
    mean_gap = float(gaps.mean()) if len(gaps) else 0.0
    return TraceStats(
        rows=len(trace),
        duration_s=duration,
        rate_rps=1.0 / mean_gap if mean_gap > 0 else None,
        interarrival_cv=float(gaps.std() / mean_gap) if mean_gap > 0 else None,
        prompt_tokens=Summary.of(trace.prompt_tokens),
        output_tokens=Summary.of(trace.output_tokens),
        prefix_reuse_bound=prefix_reuse_bound(trace),
        source=trace.source,
        notes=trace.notes,
    )


def prefix_reuse_bound(trace: Trace) -> float | None:
    """Share of prompt tokens an unbounded prefix cache could serve, at hash-block granularity.

    A request reuses its leading blocks while the chain of hashes up to each block was seen in
    an earlier request (a block counts only if every block before it matched too, as in a
    radix tree); each reused block brings its tokens, the last one possibly partial.
    Requests are taken in arrival order; a request never reuses its own blocks.
    """
    if trace.prefix_hashes is None:
        return None
    block = trace.hash_block_size
    node_of: dict[tuple[int, int], int] = {}  # (parent node, hash) -> node of the prefix tree
    hashes, offsets = trace.prefix_hashes.values.tolist(), trace.prefix_hashes.offsets.tolist()
    reused = 0
    for i, prompt in enumerate(trace.prompt_tokens.tolist()):
        parent, matched, hits = -1, True, 0
        for h in hashes[offsets[i] : offsets[i + 1]]:
            node = node_of.get((parent, h))
            if node is None:
                node = node_of[(parent, h)] = len(node_of)
                matched = False
            elif matched:
                hits += 1
            parent = node
        reused += min(hits * block, prompt)
    return reused / int(trace.prompt_tokens.sum())
