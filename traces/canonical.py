"""kvsim's own trace file: JSONL with one header line, then one request a line.

The header records what the columns alone cannot (source, hash block size, notes, row count,
which optional columns exist), so ``load(save(t))`` gives back ``t`` exactly: every column,
ragged ones included, and float arrivals bit for bit (JSON floats are written as the
shortest decimal that parses back to the same double).

    {"format": "kvsim-trace", "version": 1, "rows": 2, "source": "...", "hash_block_size": 512,
     "columns": ["arrival_s", "prompt_tokens", "output_tokens", "prefix_hashes"], "notes": []}
    {"arrival_s": 0.0, "prompt_tokens": 700, "output_tokens": 12, "prefix_hashes": [0, 1]}
    ...
"""

from __future__ import annotations

import json
from pathlib import Path

from kvsim.traces.errors import TraceFormatError
from kvsim.traces.formats import CANONICAL_TAG, Layout, first_line, read_jsonl
from kvsim.traces.rows import RAGGED_COLUMNS, REQUIRED_COLUMNS, SCALAR_COLUMNS, to_trace
from kvsim.traces.schema import Ragged, Trace

VERSION = 1


def save(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` in the canonical format; refuses a trace that breaks the schema."""
    trace.validate()
    path = Path(path)
    columns = trace.columns
    header = {
        "format": CANONICAL_TAG,
        "version": VERSION,
        "rows": len(trace),
        "source": trace.source,
        "hash_block_size": trace.hash_block_size,
        "columns": list(columns),
        "notes": list(trace.notes),
    }
    values = {
        name: column.to_rows() if isinstance(column, Ragged) else column.tolist()
        for name in columns
        for column in [getattr(trace, name)]
    }
    with path.open("w", encoding="utf-8") as out:
        out.write(json.dumps(header) + "\n")
        for i in range(len(trace)):
            out.write(json.dumps({name: values[name][i] for name in columns}) + "\n")
    return path


def read_canonical(path: Path, text: str, skip_bad: bool) -> Trace:
    number, line = first_line(text)
    header = _header(path, number, line)
    layout = Layout({c: c for c in header["columns"]}, "s", header.get("hash_block_size"), exact_ints=True)
    raw = read_jsonl(path, text, layout, skip_lines=number)
    if len(raw.lines) != header["rows"]:
        raise TraceFormatError(
            str(path), number, "rows", f"the header promises {header['rows']} rows but the file has {len(raw.lines)}"
        )
    raw.notes[:0] = header["notes"]
    return to_trace(raw, source=header["source"], hash_block_size=header.get("hash_block_size"), skip_bad=skip_bad)


def _header(path: Path, number: int, line: str) -> dict:
    def fail(field: str | None, message: str) -> TraceFormatError:
        return TraceFormatError(str(path), number, field, message)

    try:
        header = json.loads(line)
    except json.JSONDecodeError as exc:
        raise fail(None, f"malformed JSON header ({exc.msg})") from None
    if not isinstance(header, dict) or header.get("format") != CANONICAL_TAG:
        raise fail("format", f"not a kvsim trace header (expected \"format\": \"{CANONICAL_TAG}\")")
    if header.get("version") != VERSION:
        raise fail("version", f"unsupported version {header.get('version')!r} (this kvsim reads {VERSION})")
    columns = header.get("columns")
    known = SCALAR_COLUMNS + RAGGED_COLUMNS
    if not isinstance(columns, list) or not set(REQUIRED_COLUMNS) <= set(columns) or not set(columns) <= set(known):
        raise fail("columns", f"must list {', '.join(REQUIRED_COLUMNS)} and only known columns ({', '.join(known)})")
    rows = header.get("rows")
    if type(rows) is not int or rows < 0:
        raise fail("rows", "must be a non-negative integer")
    block = header.get("hash_block_size")
    if ("prefix_hashes" in columns) != (type(block) is int and block > 0):
        raise fail("hash_block_size", "must be a positive integer exactly when prefix_hashes is a column")
    if not isinstance(header.get("source"), str):
        raise fail("source", "must be a string")
    notes = header.get("notes")
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise fail("notes", "must be a list of strings")
    return header
