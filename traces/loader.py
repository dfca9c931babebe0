"""``load``: any supported trace file to a :class:`Trace`, format detected from content."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvsim.traces.canonical import read_canonical
from kvsim.traces.formats import (
    FORMAT_ALIASES,
    FORMATS,
    detect,
    first_line,
    generic_layout,
    looks_like_json,
    read_csv,
    read_jsonl,
    read_text,
)
from kvsim.traces.rows import to_trace
from kvsim.traces.schema import Trace


def load(
    path: str | Path,
    format: str | None = None,
    *,
    skip_bad: bool = False,
    columns: Mapping[str, str] | None = None,
    time_unit: str = "s",
    hash_block_size: int | None = None,
) -> Trace:
    """Read a trace file.

    ``format`` is one of :data:`traces.formats.FORMATS` (``azure``, ``mooncake``,
    ``splitwise``/``vidur``, ``burstgpt``, ``csv``, ``jsonl``, ``kvsim``) or None to detect it
    from the content. ``columns`` maps schema columns (``arrival``, ``prompt``, ``output``,
    ``hashes``, ``tokens``, ``session``, ``priority``, ``n``) to the file's column names for
    the generic ``csv``/``jsonl`` formats, whose arrivals are in ``time_unit`` (``s``, ``ms``,
    ``us``, ``ns`` or ``datetime``) and hashes over ``hash_block_size`` tokens; a mapping
    without a format means generic.

    Bad rows raise :class:`~traces.errors.TraceFormatError` naming file, line and field; with
    ``skip_bad`` they are dropped and counted by reason in ``trace.notes``.
    """
    path = Path(path)
    text = read_text(path)
    name = _resolve_format(path, text, format, columns is not None)
    fmt = FORMATS[name]
    generic = fmt.layout is None and name != "kvsim"
    if not generic and (columns is not None or hash_block_size is not None or time_unit != "s"):
        raise ValueError(f"format {name!r} has fixed columns; a mapping, time unit or block size applies to csv/jsonl")
    if name == "kvsim":
        return read_canonical(path, text, skip_bad)
    if generic and columns is None:
        raise ValueError(f"format {name!r} needs a column mapping (e.g. arrival=ts,prompt=in,output=out)")
    layout = generic_layout(columns, time_unit, hash_block_size) if generic else fmt.layout
    raw = read_csv(path, text, layout) if fmt.container == "csv" else read_jsonl(path, text, layout)
    if fmt.after_read is not None:
        fmt.after_read(raw)
    return to_trace(raw, source=f"{path.name} ({name})", hash_block_size=layout.hash_block_size, skip_bad=skip_bad)


def detect_format(path: str | Path) -> str:
    """The format ``load`` would pick for ``path``."""
    path = Path(path)
    return detect(path, read_text(path))


def _resolve_format(path: Path, text: str, format: str | None, has_mapping: bool) -> str:
    if format is not None:
        name = FORMAT_ALIASES.get(format, format)
        if name not in FORMATS:
            raise ValueError(f"unknown format {format!r}; known: {', '.join(list(FORMATS) + list(FORMAT_ALIASES))}")
        return name
    if has_mapping:
        return "jsonl" if looks_like_json(first_line(text)[1]) else "csv"
    return detect(path, text)
