"""Trace to trace: rescale time, cut, sample, fit to a model's context, spread timestamp grids.

Every transform returns a new trace that still keeps the schema's promises (sorted arrivals
starting at 0, lengths >= 1, one hash per started block) and appends a note saying what it
did, so a saved trace tells how it was made.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvsim.traces.schema import Ragged, Trace


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Arrivals ``factor`` times as frequent (gaps divided by ``factor``); lengths unchanged."""
    if not factor > 0:
        raise ValueError(f"rate factor must be > 0, got {factor}")
    return _with(trace, f"rate scaled by {factor:g}", arrival_s=trace.arrival_s / factor)


def window(trace: Trace, start_s: float, end_s: float) -> Trace:
    """Requests arriving in ``[start_s, end_s)``, re-timed from the first of them."""
    if not end_s > start_s:
        raise ValueError(f"empty window [{start_s}, {end_s})")
    lo, hi = np.searchsorted(trace.arrival_s, [start_s, end_s], side="left")
    return take(trace, np.arange(lo, hi), f"window [{start_s:g}, {end_s:g}) s: {hi - lo} of {len(trace)} requests")


def first(trace: Trace, n: int) -> Trace:
    """The first ``n`` requests."""
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    n = min(n, len(trace))
    return take(trace, np.arange(n), f"first {n} of {len(trace)} requests")


def sample(trace: Trace, n: int, seed: int = 0) -> Trace:
    """``n`` requests drawn without replacement (seeded), kept in arrival order."""
    if not 1 <= n <= len(trace):
        raise ValueError(f"cannot sample {n} of {len(trace)} requests")
    index = np.sort(np.random.default_rng(seed).choice(len(trace), size=n, replace=False))
    return take(trace, index, f"random sample of {n} of {len(trace)} requests (seed {seed})")


def clamp(
    trace: Trace,
    max_model_len: int | None = None,
    *,
    max_prompt: int | None = None,
    max_output: int | None = None,
) -> Trace:
    """Fit every request to a model: ``prompt + output <= max_model_len`` (the prompt keeps
    its head and at least one output token remains), and optionally cap each length.

    Hashes are cut to the blocks the shorter prompt still starts. A block cut short holds
    different tokens than the full one, so it gets a fresh id, the same for every request
    that cut the same block at the same length (they share that partial content).
    """
    prompt, output = trace.prompt_tokens.copy(), trace.output_tokens.copy()
    if max_prompt is not None:
        prompt = np.minimum(prompt, _at_least(1, max_prompt, "max_prompt"))
    if max_output is not None:
        output = np.minimum(output, _at_least(1, max_output, "max_output"))
    if max_model_len is not None:
        prompt = np.minimum(prompt, _at_least(2, max_model_len, "max_model_len") - 1)
        output = np.minimum(output, max_model_len - prompt)
    changed = int(np.count_nonzero((prompt != trace.prompt_tokens) | (output != trace.output_tokens)))
    limits = ", ".join(
        f"{name} {value}"
        for name, value in (("max_model_len", max_model_len), ("max_prompt", max_prompt), ("max_output", max_output))
        if value is not None
    )
    return _with(
        trace,
        f"clamped to {limits}: {changed} requests shortened",
        prompt_tokens=prompt,
        output_tokens=output,
        prefix_hashes=_cut_hashes(trace, prompt),
        token_ids=None if trace.token_ids is None else _cut_rows(trace.token_ids, prompt),
    )


def shrink_lengths(trace: Trace, factor: int) -> Trace:
    """Divide every length by ``factor`` (rounding up) and the hash block size with it, so a
    long-context trace keeps its prefix-sharing structure at a size a small model can run."""
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if trace.token_ids is not None:
        raise ValueError("cannot shrink a trace that carries token ids")
    block = trace.hash_block_size
    if block is not None and block % factor:
        raise ValueError(f"factor {factor} does not divide the hash block size {block}")
    # ceil(ceil(p / f) / (B / f)) == ceil(p / B): every request keeps its number of blocks
    return _with(
        trace,
        f"lengths divided by {factor} (rounded up)",
        prompt_tokens=-(-trace.prompt_tokens // factor),
        output_tokens=-(-trace.output_tokens // factor),
        hash_block_size=None if block is None else block // factor,
    )


def spread_buckets(trace: Trace, width_s: float | None = None) -> Trace:
    """Spread requests that share a timestamp evenly over their bucket instead of a burst.

    Traces such as Mooncake's record arrivals on a coarse grid (about 3 s): replayed as is,
    each bucket arrives as one burst. Here the k requests of a bucket at time t arrive at
    ``t + j * w / k`` (j = 0..k-1, in file order), with ``w`` the bucket width (default: the
    median gap between distinct timestamps), never reaching the next bucket. Deterministic.
    """
    times, starts, counts = np.unique(trace.arrival_s, return_index=True, return_counts=True)
    if len(times) < 2 and width_s is None:
        raise ValueError("cannot infer a bucket width from a single timestamp; pass width_s")
    width = float(np.median(np.diff(times))) if width_s is None else width_s
    if not width > 0:
        raise ValueError(f"bucket width must be > 0, got {width}")
    span = np.minimum(width, np.append(np.diff(times), np.inf))
    rank = np.arange(len(trace)) - np.repeat(starts, counts)  # position inside the bucket
    arrival = trace.arrival_s + rank * np.repeat(span / counts, counts)
    return _with(trace, f"timestamp buckets spread over {width:g} s", arrival_s=arrival)


def take(trace: Trace, index: np.ndarray, note: str | None = None) -> Trace:
    """Rows ``index`` (strictly ascending) of every column, re-timed so the first arrives at 0."""
    index = np.asarray(index, dtype=np.int64)
    note = note or f"{len(index)} selected of {len(trace)} requests"
    if len(index) == 0:
        raise ValueError(f"no requests left ({note})")
    if np.any(np.diff(index) <= 0) or index[0] < 0 or index[-1] >= len(trace):
        raise ValueError("row index must be strictly ascending and within the trace")
    changes: dict[str, object] = {}
    for name in trace.columns:
        column = getattr(trace, name)
        changes[name] = column.take(index) if isinstance(column, Ragged) else column[index]
    changes["arrival_s"] = changes["arrival_s"] - changes["arrival_s"][0]
    return _with(trace, note, **changes)


def _at_least(minimum: int, value: int, name: str) -> int:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _with(trace: Trace, note: str, **changes) -> Trace:
    return dataclasses.replace(trace, notes=trace.notes + (note,), **changes)


def _cut_rows(rows: Ragged, lengths: np.ndarray) -> Ragged:
    """Each row's first ``lengths[i]`` values."""
    return Ragged.from_rows([rows.row(i)[:k] for i, k in enumerate(lengths.tolist())])


def _cut_hashes(trace: Trace, prompt: np.ndarray) -> Ragged | None:
    hashes, block = trace.prefix_hashes, trace.hash_block_size
    if hashes is None:
        return None
    rows = hashes.to_rows()
    fresh: dict[tuple[int, int], int] = {}  # (original id, kept tokens) -> new id
    next_id = int(hashes.values.max()) + 1 if len(hashes.values) else 0
    old_prompt = trace.prompt_tokens.tolist()
    for i, (new, old) in enumerate(zip(prompt.tolist(), old_prompt)):
        if new == old:
            continue
        kept_blocks = -(-new // block)
        row = rows[i][:kept_blocks]
        tail = new - (kept_blocks - 1) * block  # tokens in the last kept block
        old_tail = min(block, old - (kept_blocks - 1) * block)
        if tail != old_tail:
            key = (row[-1], tail)
            if key not in fresh:
                fresh[key] = next_id
                next_id += 1
            row[-1] = fresh[key]
        rows[i] = row
    return Ragged.from_rows(rows)
