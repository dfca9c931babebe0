"""Turn one column of raw cells (CSV strings or JSON values) into numbers, recording bad cells.

Every parser takes the whole column at once so the common case is one vectorised numpy call;
only when that fails does it walk the cells to find and record the bad ones. Bad cells become
placeholders (NaN, 0, empty list) and a :class:`~traces.errors.Problem` for their row.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from itertools import chain

import numpy as np

from kvsim.traces.errors import Problem, RowProblems


class _Missing:
    """Marks a JSON key that is absent from its row (distinct from an explicit null)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()
_INT64_MAX = 2**63 - 1


def _scalar_problem(cell: object) -> str | None:
    """Why ``cell`` cannot be a number, or None when ``float(cell)`` is meaningful."""
    if cell is MISSING:
        return "is missing"
    if cell is None:
        return "is null"
    if isinstance(cell, str):
        return "is empty" if not cell.strip() else None
    if isinstance(cell, bool) or not isinstance(cell, (int, float)):
        return "is not a number"
    return None


def numbers(cells: Sequence[object], field: str, problems: RowProblems) -> np.ndarray:
    """float64 column; NaN where a cell is missing, empty or not a number."""
    kinds = set(map(type, cells))
    try:
        if kinds <= {int, float}:
            return np.array(cells, dtype=np.float64)
        if kinds == {str}:
            return np.array(cells, dtype=np.str_).astype(np.float64)
    except (ValueError, OverflowError):
        pass
    out = np.full(len(cells), np.nan)
    for row, cell in enumerate(cells):
        reason = _scalar_problem(cell)
        if reason is None:
            try:
                out[row] = float(cell)  # type: ignore[arg-type]
                continue
            except ValueError:
                reason = "is not a number"
        problems.add(row, Problem(field, reason, repr(cell) if reason == "is not a number" else ""))
    return out


def exact_ints(cells: Sequence[object], field: str, problems: RowProblems) -> np.ndarray:
    """int64 column from JSON integers, exactly (no detour through float64)."""
    if set(map(type, cells)) == {int}:
        try:
            return np.array(cells, dtype=np.int64)
        except OverflowError:
            pass
    out = np.zeros(len(cells), dtype=np.int64)
    for row, cell in enumerate(cells):
        if type(cell) is int and -_INT64_MAX - 1 <= cell <= _INT64_MAX:
            out[row] = cell
        else:
            reason = _scalar_problem(cell) or "is not a 64-bit integer"
            problems.add(row, Problem(field, reason, "" if cell is MISSING else repr(cell)))
    return out


def datetimes_ns(cells: Sequence[object], field: str, problems: RowProblems) -> np.ndarray:
    """int64 nanoseconds since the epoch from ISO-like datetime strings (e.g. Azure's
    ``2023-11-16 18:15:46.6805900``). numpy parses the 7-digit fraction exactly; a zone
    suffix, if any, is folded into UTC, which leaves differences between rows unchanged."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy warns that it folds explicit zones into UTC
        if set(map(type, cells)) == {str}:
            try:
                parsed = np.array(cells, dtype="datetime64[ns]")
                if not np.isnat(parsed).any():
                    return parsed.astype(np.int64)
            except ValueError:
                pass
        out = np.zeros(len(cells), dtype=np.int64)
        for row, cell in enumerate(cells):
            reason = _scalar_problem(cell)
            if reason is None:
                value = _datetime_or_nat(cell)
                if not np.isnat(value):
                    out[row] = value.astype(np.int64)
                    continue
                reason = "is not a datetime"
            problems.add(row, Problem(field, reason, "" if cell is MISSING else repr(cell)))
        return out


def _datetime_or_nat(cell: object) -> np.datetime64:
    if isinstance(cell, str):
        try:
            return np.datetime64(cell.strip(), "ns")
        except ValueError:
            pass
    return np.datetime64("NaT", "ns")


def labels(cells: Sequence[object], field: str, problems: RowProblems) -> np.ndarray:
    """int64 codes numbering distinct labels (strings or numbers) 0, 1, ... by first appearance."""
    codes = np.zeros(len(cells), dtype=np.int64)
    seen: dict[object, int] = {}
    for row, cell in enumerate(cells):
        reason = _scalar_problem(cell)
        if reason is not None and reason != "is not a number":
            problems.add(row, Problem(field, reason))
            continue
        key = cell.strip() if isinstance(cell, str) else cell
        codes[row] = seen.setdefault(key, len(seen))  # type: ignore[arg-type]
    return codes


_ID_SEPARATORS = re.compile(r"[\s,;]+")


def id_lists(cells: Sequence[object], field: str, problems: RowProblems) -> list[list[int]]:
    """Lists of int64 ids: JSON arrays of integers, or CSV strings such as ``"[1, 2, 3]"``
    or ``"1 2 3"``. A bad list becomes ``[]`` with a problem recorded for its row."""
    if _all_int64_lists(cells):
        return list(cells)  # type: ignore[arg-type]
    out: list[list[int]] = []
    for row, cell in enumerate(cells):
        ids = _id_list(cell)
        if isinstance(ids, str):
            problems.add(row, Problem(field, ids, "" if cell is MISSING else repr(cell)[:60]))
            ids = []
        out.append(ids)
    return out


def _all_int64_lists(cells: Sequence[object]) -> bool:
    """Whether every cell is already a list of int64 integers: one pass over the whole column in C
    (a million-row trace holds tens of millions of ids), before any row-by-row look for a bad one."""
    if set(map(type, cells)) != {list}:
        return False
    ids = list(chain.from_iterable(cells))  # type: ignore[arg-type]
    return not ids or (set(map(type, ids)) == {int} and -_INT64_MAX - 1 <= min(ids) and max(ids) <= _INT64_MAX)


def _id_list(cell: object) -> list[int] | str:
    """The ids in ``cell``, or why there are none."""
    if isinstance(cell, str):
        body = cell.strip().removeprefix("[").removesuffix("]").strip()
        try:
            cell = [int(tok) for tok in _ID_SEPARATORS.split(body)] if body else []
        except ValueError:
            return "is not a list of integers"
    if cell is MISSING:
        return "is missing"
    if not isinstance(cell, list):
        return "is not a list of integers"
    if not all(type(v) is int and -_INT64_MAX - 1 <= v <= _INT64_MAX for v in cell):
        return "is not a list of integers"
    return cell
