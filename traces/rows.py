"""From parsed columns to a valid :class:`Trace`: the checks every loader shares.

A reader fills :class:`RawRows` (one entry per data row, in file order, with its line number)
and records the problems it met while parsing; :func:`to_trace` adds the semantic checks
(finite, integer, >= 1, hash count), then raises for the earliest bad row or, with
``skip_bad``, drops the bad rows and notes how many for each reason. Finally it sorts rows by
arrival (stably, noting it) and measures arrivals in seconds from the first request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from kvsim.traces.errors import Problem, RowProblems, TraceFormatError
from kvsim.traces.schema import Ragged, Trace

SCALAR_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens", "session_id", "priority", "n_samples")
RAGGED_COLUMNS = ("prefix_hashes", "token_ids")
REQUIRED_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
# smallest allowed value of each integer column (None: any integer)
_LARGEST_EXACT = 2.0**53  # float64 holds every integer up to here
_INT_MINIMUM = {"prompt_tokens": 1, "output_tokens": 1, "n_samples": 1, "session_id": None, "priority": None}


@dataclass
class RawRows:
    """Columns as read, before validation. ``arrival`` is in ticks of ``ticks_per_second``
    (int64 nanoseconds for datetimes, so epoch times keep full precision); other scalar
    columns are float64 (or int64 when read exactly); ragged columns are lists of id lists."""

    path: str
    lines: np.ndarray
    names: dict[str, str]  # schema column -> its name in the file, for messages
    ticks_per_second: float
    scalars: dict[str, np.ndarray]
    ragged: dict[str, list[list[int]]] = field(default_factory=dict)
    problems: RowProblems = field(default_factory=RowProblems)
    excluded: np.ndarray | None = None  # rows a format defines as not requests (noted, not errors)
    notes: list[str] = field(default_factory=list)

    def exclude(self, mask: np.ndarray, note: str) -> None:
        """Leave out rows that the format itself marks as non-requests; counted in a note."""
        count = int(mask.sum())
        if count:
            self.excluded = mask if self.excluded is None else self.excluded | mask
            self.notes.append(note.format(count=count))


def to_trace(raw: RawRows, *, source: str, hash_block_size: int | None, skip_bad: bool) -> Trace:
    """Validate, drop or reject bad rows, sort by arrival and build the trace."""
    _check_values(raw, hash_block_size)
    keep = np.ones(len(raw.lines), dtype=bool) if raw.excluded is None else ~raw.excluded
    notes = list(raw.notes)
    if raw.problems:
        if not skip_bad:
            row, problem = raw.problems.earliest()
            raise TraceFormatError(raw.path, int(raw.lines[row]), problem.field, problem.message())
        bad_rows = np.fromiter(raw.problems.by_row, dtype=np.int64)
        keep[bad_rows] = False
        notes.extend(raw.problems.skip_notes(raw.lines))
    index = np.flatnonzero(keep)
    if len(index) == 0:
        raise TraceFormatError(raw.path, None, None, "no valid rows (" + "; ".join(notes) + ")")
    arrival = raw.scalars["arrival_s"][index]
    out_of_order = int(np.count_nonzero(arrival[1:] < arrival[:-1]))
    if out_of_order:
        index = index[np.argsort(arrival, kind="stable")]
        arrival = raw.scalars["arrival_s"][index]
        notes.append(f"sorted by arrival time: {out_of_order} rows arrived earlier than the row before them")
    return Trace(
        arrival_s=(arrival - arrival[0]).astype(np.float64) / raw.ticks_per_second,
        prompt_tokens=_as_int64(raw.scalars["prompt_tokens"][index]),
        output_tokens=_as_int64(raw.scalars["output_tokens"][index]),
        source=source,
        prefix_hashes=_take_ragged(raw, "prefix_hashes", index),
        hash_block_size=hash_block_size if "prefix_hashes" in raw.ragged else None,
        token_ids=_take_ragged(raw, "token_ids", index),
        session_id=_optional_int64(raw, "session_id", index),
        priority=_optional_int64(raw, "priority", index),
        n_samples=_optional_int64(raw, "n_samples", index),
        notes=tuple(notes),
    )


def _check_values(raw: RawRows, hash_block_size: int | None) -> None:
    active = np.ones(len(raw.lines), dtype=bool) if raw.excluded is None else ~raw.excluded
    arrival = raw.scalars["arrival_s"]
    if arrival.dtype.kind == "f":
        _add(raw, ~np.isfinite(arrival) & active, "arrival_s", "is NaN or infinite", arrival)
    for column, minimum in _INT_MINIMUM.items():
        values = raw.scalars.get(column)
        if values is None:
            continue
        if values.dtype.kind == "f":
            finite = np.isfinite(values)
            _add(raw, ~finite & active, column, "is NaN or infinite", values)
            _add(raw, finite & (values != np.floor(values)) & active, column, "is not an integer", values)
            _add(raw, finite & (np.abs(values) > _LARGEST_EXACT) & active, column, "is too large", values)
        if minimum is not None:
            _add(raw, (values < 0) & active, column, "is negative", values)
            _add(raw, (values == 0) & active, column, f"is zero (must be >= {minimum})", values)
    prompt = raw.scalars["prompt_tokens"]
    if "prefix_hashes" in raw.ragged:
        counts = np.fromiter(map(len, raw.ragged["prefix_hashes"]), dtype=np.int64, count=len(prompt))
        expected = np.ceil(np.nan_to_num(prompt) / hash_block_size).astype(np.int64)
        for row in np.flatnonzero((counts != expected) & (prompt >= 1) & active):
            raw.problems.add(
                int(row),
                Problem(
                    raw.names["prefix_hashes"],
                    f"count does not match ceil(prompt tokens / {hash_block_size})",
                    f"{counts[row]} ids for {prompt[row]:g} tokens, expected {expected[row]}",
                ),
            )
    if "token_ids" in raw.ragged:
        counts = np.fromiter(map(len, raw.ragged["token_ids"]), dtype=np.int64, count=len(prompt))
        for row in np.flatnonzero((counts != prompt) & (prompt >= 1) & active):
            raw.problems.add(
                int(row),
                Problem(raw.names["token_ids"], "count does not match prompt tokens", f"{counts[row]} ids for {prompt[row]:g} tokens"),
            )


def _add(raw: RawRows, mask: np.ndarray, column: str, reason: str, values: np.ndarray) -> None:
    rows = np.flatnonzero(mask)
    raw.problems.add_rows(rows, raw.names[column], reason, [f"{values[r]:g}" for r in rows])


def _as_int64(values: np.ndarray) -> np.ndarray:
    return values if values.dtype == np.int64 else values.astype(np.int64)


def _optional_int64(raw: RawRows, column: str, index: np.ndarray) -> np.ndarray | None:
    values = raw.scalars.get(column)
    return None if values is None else _as_int64(values[index])


def _take_ragged(raw: RawRows, column: str, index: np.ndarray) -> Ragged | None:
    rows = raw.ragged.get(column)
    if rows is None:
        return None
    kept = [rows[i] for i in index.tolist()]
    lengths = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
    flat = np.fromiter(chain.from_iterable(kept), dtype=np.int64, count=int(lengths.sum()))
    return Ragged.from_lengths(flat, lengths)
