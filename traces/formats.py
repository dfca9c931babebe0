"""Trace file formats: what each looks like, how to recognise it, and how to read it.

Every format is CSV or JSONL and differs only in which column holds which schema field, the
time unit, and a format-specific rule or two, so one CSV reader and one JSONL reader serve all
of them through a :class:`Layout`. Detection reads the content (CSV header or first JSON
object), never the file name.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim.traces import parse
from kvsim.traces.errors import Problem, RowProblems, TraceFormatError
from kvsim.traces.rows import RAGGED_COLUMNS, REQUIRED_COLUMNS, SCALAR_COLUMNS, RawRows

TICKS_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9, "datetime": 1e9}

# short names accepted in a column mapping (``--map arrival=ts,prompt=in,output=out``)
COLUMN_ALIASES = {
    "arrival": "arrival_s",
    "prompt": "prompt_tokens",
    "output": "output_tokens",
    "hashes": "prefix_hashes",
    "tokens": "token_ids",
    "session": "session_id",
    "priority": "priority",
    "n": "n_samples",
}


@dataclass(frozen=True)
class Layout:
    """Where each schema column lives in a file and how to read it."""

    columns: Mapping[str, str]  # schema column -> CSV column / JSON key
    time_unit: str = "s"
    hash_block_size: int | None = None
    optional: frozenset[str] = frozenset()  # read only when the file has them
    exact_ints: bool = False  # integers read exactly and session ids kept as they are (canonical)


@dataclass(frozen=True)
class Format:
    name: str
    container: str  # "csv" or "jsonl"
    layout: Layout | None  # None: generic (the caller supplies it) or canonical (its header does)
    after_read: Callable[[RawRows], None] | None = field(default=None, compare=False)

    def signature(self) -> frozenset[str]:
        """File columns whose presence identifies the format."""
        assert self.layout is not None
        return frozenset(v for k, v in self.layout.columns.items() if k not in self.layout.optional)


def _burstgpt_failures(raw: RawRows) -> None:
    # BurstGPT logs a failed request as a row with Response tokens = 0 (its authors publish a
    # "without_fails" file that drops exactly these rows). A failed request generated nothing
    # the trace can replay, so it is not a request here: left out, and counted in the notes.
    raw.exclude(
        raw.scalars["output_tokens"] == 0,
        "left out {count} failed requests (Response tokens = 0 is BurstGPT's mark of a failure)",
    )


def _mooncake_grid(raw: RawRows) -> None:
    distinct = len(np.unique(raw.scalars["arrival_s"]))
    if distinct * 2 <= len(raw.lines):
        raw.notes.append(
            f"{len(raw.lines)} requests share {distinct} distinct timestamps: each group arrives "
            "as one burst (spread_buckets / --spread-buckets spreads them)"
        )


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        # Azure LLM inference trace 2023: datetimes with 7-digit fractions, no zone
        Format(
            "azure",
            "csv",
            Layout({"arrival_s": "TIMESTAMP", "prompt_tokens": "ContextTokens", "output_tokens": "GeneratedTokens"}, "datetime"),
        ),
        # Mooncake FAST'25: timestamp in ms, hash_ids over 512-token blocks
        Format(
            "mooncake",
            "jsonl",
            Layout(
                {"arrival_s": "timestamp", "prompt_tokens": "input_length", "output_tokens": "output_length", "prefix_hashes": "hash_ids"},
                "ms",
                hash_block_size=512,
                optional=frozenset({"prefix_hashes"}),
            ),
            _mooncake_grid,
        ),
        # Splitwise / Vidur processed traces: arrived_at in seconds
        Format(
            "splitwise",
            "csv",
            Layout({"arrival_s": "arrived_at", "prompt_tokens": "num_prefill_tokens", "output_tokens": "num_decode_tokens"}),
        ),
        # BurstGPT: Timestamp in seconds; v2 files add a Session ID column
        Format(
            "burstgpt",
            "csv",
            Layout(
                {"arrival_s": "Timestamp", "prompt_tokens": "Request tokens", "output_tokens": "Response tokens",
                 "session_id": "Session ID"},
                optional=frozenset({"session_id"}),
            ),
            _burstgpt_failures,
        ),
        Format("csv", "csv", None),  # any CSV, with a column mapping and a time unit
        Format("jsonl", "jsonl", None),  # any JSONL, with a column mapping and a time unit
        Format("kvsim", "jsonl", None),  # kvsim's canonical JSONL (traces.canonical)
    )
}
FORMAT_ALIASES = {"vidur": "splitwise"}
CANONICAL_TAG = "kvsim-trace"


def read_text(path: Path) -> str:
    """The file as text; empty files and non-UTF-8 bytes are format errors."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(str(path), data[: exc.start].count(b"\n") + 1, None, "not UTF-8 text") from None
    if not text.strip():
        raise TraceFormatError(str(path), 1, None, "file is empty")
    return text


def first_line(text: str) -> tuple[int, str]:
    """Line number and content of the first non-blank line."""
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            return number, line.strip()
    raise AssertionError("read_text guarantees a non-blank line")


def looks_like_json(line: str) -> bool:
    return line.startswith(("{", "["))


def detect(path: Path, text: str) -> str:
    """The format name, judged from the CSV header or the first JSON object."""
    number, line = first_line(text)
    if looks_like_json(line):
        try:
            first = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(str(path), number, None, f"malformed JSON ({exc.msg})") from None
        if not isinstance(first, dict):
            raise TraceFormatError(str(path), number, None, "the first JSON line is not an object")
        if first.get("format") == CANONICAL_TAG:
            return "kvsim"
        keys, kind = set(first), "jsonl"
    else:
        keys, kind = {name.strip() for name in next(csv.reader([line]))}, "csv"
    for fmt in FORMATS.values():
        if fmt.container == kind and fmt.layout is not None and fmt.signature() <= keys:
            return fmt.name
    raise TraceFormatError(
        str(path), number, None,
        f"unrecognised {kind.upper()} columns {sorted(keys)}; known formats: "
        + ", ".join(f.name for f in FORMATS.values() if f.layout is not None)
        + f"; or pass format='{kind}' with a column mapping",
    )


def generic_layout(columns: Mapping[str, str], time_unit: str, hash_block_size: int | None) -> Layout:
    """A layout from a user's mapping (short or full schema names -> file columns)."""
    resolved: dict[str, str] = {}
    for key, name in columns.items():
        schema = COLUMN_ALIASES.get(key, key)
        if schema not in SCALAR_COLUMNS + RAGGED_COLUMNS:
            raise ValueError(f"unknown column {key!r} in the mapping; use {', '.join(COLUMN_ALIASES)}")
        resolved[schema] = name
    missing = [c for c in REQUIRED_COLUMNS if c not in resolved]
    if missing:
        raise ValueError("the column mapping needs " + ", ".join(k for k, v in COLUMN_ALIASES.items() if v in missing))
    if time_unit not in TICKS_PER_SECOND:
        raise ValueError(f"unknown time unit {time_unit!r}; use one of {', '.join(TICKS_PER_SECOND)}")
    if "prefix_hashes" in resolved and not (hash_block_size and hash_block_size > 0):
        raise ValueError("a hashes column needs a positive hash_block_size")
    return Layout(resolved, time_unit, hash_block_size)


def read_csv(path: Path, text: str, layout: Layout) -> RawRows:
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    header_line = 0
    rows: list[list[str]] = []
    lines: list[int] = []
    try:
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if header is None:
                header, header_line = [name.strip() for name in row], reader.line_num
            else:
                rows.append(row)
                lines.append(reader.line_num)
    except csv.Error as exc:
        raise TraceFormatError(str(path), reader.line_num, None, f"unreadable CSV ({exc})") from None
    if header is None:
        raise TraceFormatError(str(path), 1, None, "file is empty")
    if not rows:
        raise TraceFormatError(str(path), header_line + 1, None, "no data rows after the header")
    position = {name: i for i, name in enumerate(header)}
    for schema, name in layout.columns.items():
        if name not in position and schema not in layout.optional:
            raise TraceFormatError(str(path), header_line, name, f"missing column (the header has {header})")
    problems = RowProblems()
    for row_index, row in enumerate(rows):
        if len(row) != len(header):
            problems.add(row_index, Problem(None, f"has {len(row)} fields where the header has {len(header)}"))
    cells = {
        schema: [row[position[name]] if position[name] < len(row) else "" for row in rows]
        for schema, name in layout.columns.items()
        if name in position
    }
    return _raw_rows(path, np.array(lines, dtype=np.int64), layout, cells, problems)


def read_jsonl(path: Path, text: str, layout: Layout, skip_lines: int = 0) -> RawRows:
    """Rows of a JSONL file after its first ``skip_lines`` lines (a canonical header)."""
    objects: list[dict | None] = []
    lines: list[int] = []
    problems = RowProblems()
    for number, line in enumerate(text.split("\n"), start=1):
        if number <= skip_lines or not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.add(len(objects), Problem(None, "malformed JSON", exc.msg))
            obj = None
        if obj is not None and not isinstance(obj, dict):
            problems.add(len(objects), Problem(None, "is not a JSON object"))
            obj = None
        objects.append(obj)
        lines.append(number)
    if not objects:
        raise TraceFormatError(str(path), skip_lines + 1, None, "no data rows after the header")
    first = next((o for o in objects if o is not None), {})
    cells = {
        schema: [parse.MISSING if o is None else o.get(key, parse.MISSING) for o in objects]
        for schema, key in layout.columns.items()
        if schema not in layout.optional or key in first
    }
    return _raw_rows(path, np.array(lines, dtype=np.int64), layout, cells, problems)


def _raw_rows(path: Path, lines: np.ndarray, layout: Layout, cells: dict[str, list], problems: RowProblems) -> RawRows:
    names = dict(layout.columns)
    scalars: dict[str, np.ndarray] = {}
    ragged: dict[str, list[list[int]]] = {}
    for schema, column in cells.items():
        name = names[schema]
        if schema in RAGGED_COLUMNS:
            ragged[schema] = parse.id_lists(column, name, problems)
        elif schema == "arrival_s" and layout.time_unit == "datetime":
            scalars[schema] = parse.datetimes_ns(column, name, problems)
        elif schema == "arrival_s":
            scalars[schema] = parse.numbers(column, name, problems)
        elif layout.exact_ints:
            scalars[schema] = parse.exact_ints(column, name, problems)
        elif schema == "session_id":
            scalars[schema] = parse.labels(column, name, problems)
        else:
            scalars[schema] = parse.numbers(column, name, problems)
    return RawRows(
        path=str(path),
        lines=lines,
        names=names,
        ticks_per_second=TICKS_PER_SECOND[layout.time_unit],
        scalars=scalars,
        ragged=ragged,
        problems=problems,
    )
