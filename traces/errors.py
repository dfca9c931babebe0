"""The one error a trace loader raises for bad input, and the ledger of rows it may skip instead."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class TraceFormatError(ValueError):
    """Bad trace input, located: ``path``, 1-based ``line`` and ``field`` (either may be None)."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str) -> None:
        self.path = path
        self.line = line
        self.field = field
        self.message = message
        where = [path]
        if line is not None:
            where.append(f"line {line}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(f"{', '.join(where)}: {message}")


@dataclass(frozen=True)
class Problem:
    """What is wrong with one row: ``reason`` is the countable kind, ``detail`` the specifics."""

    field: str | None
    reason: str
    detail: str = ""

    @property
    def kind(self) -> str:
        return f"{self.field} {self.reason}" if self.field else self.reason

    def message(self) -> str:
        return f"{self.reason} ({self.detail})" if self.detail else self.reason


@dataclass
class RowProblems:
    """First problem of each bad row, keyed by row index (rows are numbered from 0 in file order).

    Readers and validators record problems as they find them; at the end the loader either
    raises for the earliest bad row or, when told to skip bad rows, drops them and reports
    how many it dropped for each kind of problem.
    """

    by_row: dict[int, Problem] = field(default_factory=dict)

    def add(self, row: int, problem: Problem) -> None:
        self.by_row.setdefault(row, problem)

    def add_rows(self, rows: Iterable[int], field_name: str | None, reason: str, details: Sequence[str] | None = None) -> None:
        """Record the same kind of problem for many rows; ``details[k]`` belongs to ``rows[k]``."""
        for k, row in enumerate(rows):
            self.add(int(row), Problem(field_name, reason, "" if details is None else details[k]))

    def __bool__(self) -> bool:
        return bool(self.by_row)

    def earliest(self) -> tuple[int, Problem]:
        row = min(self.by_row)
        return row, self.by_row[row]

    def skip_notes(self, lines: Sequence[int]) -> list[str]:
        """One note per kind: how many rows were skipped and the first line it happened on."""
        counts: Counter[str] = Counter()
        first_line: dict[str, int] = {}
        for row in sorted(self.by_row):
            kind = self.by_row[row].kind
            counts[kind] += 1
            first_line.setdefault(kind, int(lines[row]))
        return [
            f"skipped {n} bad row{'s' if n > 1 else ''}: {kind} (first at line {first_line[kind]})"
            for kind, n in counts.most_common()
        ]


FIDELITY_EXTRA = "pip install 'kvsim[fidelity]'"


class MissingExtraError(ImportError):
    """An optional package kvsim does not require is needed: the message names the extra to install."""

    def __init__(self, what: str, package: str) -> None:
        super().__init__(f"{what} needs the package {package!r}, which is not installed: {FIDELITY_EXTRA}")
