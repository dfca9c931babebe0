"""Reading a run directory (the files ``kvsim simulate`` and ``kvsim execute`` write) into arrays.

Reports only read results, so every problem with the input is a :class:`ReportInputError`
whose message names the path (and, inside a CSV, the line and column) at fault.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.sim.run.outputs import REQUESTS, STEPS, SUMMARY

# the columns reports read (a subset of sim.run.metrics' STEP_COLUMNS and REQUEST_COLUMNS)
STEP_FIELDS = ("step", "start_s", "duration_s", "kind", "batch_size", "prefill_tokens", "decode_tokens",
               "kv_used", "kv_cached", "kv_free")
REQUEST_FIELDS = ("request_id", "parent", "status", "reject_reason", "arrival_s", "ttft_s", "tpot_s", "finish_s")
STRING_COLUMNS = frozenset({"kind", "request_id", "parent", "status", "reject_reason"})


MAX_LABEL = 40


class ReportInputError(ValueError):
    """A report's input is missing or malformed; the message names the path."""


@dataclass(frozen=True)
class Run:
    """One run directory's contents: its summary and its CSV columns (floats, NaN for empty cells)."""

    path: Path
    summary: dict
    steps: dict[str, np.ndarray]
    requests: dict[str, np.ndarray]

    @property
    def config(self) -> dict:
        return self.summary.get("config") or {}

    @property
    def num_blocks(self) -> int:
        return int(self.summary["num_kv_blocks"])


def load_run(path: Path | str) -> Run:
    """Read ``summary.json``, ``steps.csv`` and ``requests.csv`` of a run directory."""
    path = Path(path)
    if not path.is_dir():
        raise ReportInputError(f"{path}: not a directory")
    summary_path = path / SUMMARY
    if not summary_path.is_file():
        raise ReportInputError(f"{path}: not a kvsim run directory (no {SUMMARY})")
    summary = read_json(summary_path)
    if not isinstance(summary, dict) or "num_kv_blocks" not in summary:
        raise ReportInputError(f"{summary_path}: not a kvsim run summary (no num_kv_blocks)")
    return Run(
        path=path,
        summary=summary,
        steps=read_columns(path / STEPS, STEP_FIELDS, optional={"timed": 1.0}),
        requests=read_columns(path / REQUESTS, REQUEST_FIELDS),
    )


def is_run_dir(path: Path) -> bool:
    return (Path(path) / SUMMARY).is_file()


def read_json(path: Path) -> object:
    if not path.is_file():
        raise ReportInputError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportInputError(f"{path}: line {exc.lineno}: invalid JSON ({exc.msg})") from None


def read_columns(path: Path, expected: tuple[str, ...], optional: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """A CSV's ``expected`` columns: text as str arrays, the others as float64 (empty cells are NaN).

    ``optional`` columns that older run directories lack are filled with their default.
    """
    if not path.is_file():
        raise ReportInputError(f"{path}: missing")
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise ReportInputError(f"{path}: empty file (no header)")
        missing = [c for c in expected if c not in header]
        if missing:
            raise ReportInputError(f"{path}: line 1: missing column(s) {', '.join(missing)}")
        rows = list(reader)
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ReportInputError(f"{path}: line {i + 2}: {len(row)} fields, the header has {len(header)}")
    cells = dict(zip(header, zip(*rows))) if rows else {h: () for h in header}
    columns = {name: _column(path, name, cells[name]) for name in expected}
    for name, default in (optional or {}).items():
        columns[name] = _column(path, name, cells[name]) if name in header else np.full(len(rows), default)
    return columns


def _column(path: Path, name: str, cells: tuple[str, ...]) -> np.ndarray:
    if name in STRING_COLUMNS:
        return np.asarray(cells, dtype=str)
    try:
        return np.asarray([c if c else "nan" for c in cells], dtype=np.float64)
    except ValueError:
        for i, cell in enumerate(cells):
            try:
                float(cell or "nan")
            except ValueError:
                raise ReportInputError(f"{path}: line {i + 2}: column {name}: not a number: {cell!r}") from None
        raise


def default_labels(runs: list[Run]) -> list[str]:
    """Short names that tell runs apart: the config fields whose values differ, else directory names.

    Scheduler and block manager are shown by value (``fcfs paged``), other fields as
    ``key=value``. Runs whose distinguishing fields coincide, or differ in too many to read
    as a label, fall back to their directory names.
    """
    configs = [{k: v for k, v in r.config.items() if k != "resolved"} for r in runs]
    keys = sorted({k for c in configs for k in c}, key=_label_order)
    differing = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
    labels = [" ".join(_label_part(k, c.get(k)) for k in differing) for c in configs]
    if len(runs) < 2 or not differing or len(set(labels)) < len(labels) or max(map(len, labels)) > MAX_LABEL:
        return [r.path.resolve().name for r in runs]
    return labels


def _label_order(key: str) -> tuple[int, str]:
    return ({"scheduler": 0, "block_manager": 1}.get(key, 2), key)


def _label_part(key: str, value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if key in ("scheduler", "block_manager") else f"{key}={text}"
