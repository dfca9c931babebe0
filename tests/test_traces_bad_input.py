"""Bad input: one clear error naming file, line and field, or (skip_bad) counted skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsim import traces
from kvsim.traces import TraceFormatError

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
OK_AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def error_of(path: Path, **kwargs) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as info:
        traces.load(path, **kwargs)
    return info.value


def mooncake_row(ts: int, inp: object, out: object, hashes: object) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": hashes}) + "\n"


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ("2023-11-16 18:15:47.0000000,abc,44\n", "ContextTokens", "is not a number ('abc')"),
        ("2023-11-16 18:15:47.0000000,-5,44\n", "ContextTokens", "is negative (-5)"),
        ("2023-11-16 18:15:47.0000000,nan,44\n", "ContextTokens", "is NaN or infinite (nan)"),
        ("2023-11-16 18:15:47.0000000,12.5,44\n", "ContextTokens", "is not an integer (12.5)"),
        ("2023-11-16 18:15:47.0000000,0,44\n", "ContextTokens", "is zero (must be >= 1) (0)"),
        ("2023-11-16 18:15:47.0000000,10,0\n", "GeneratedTokens", "is zero (must be >= 1) (0)"),
        ("2023-11-16 18:15:47.0000000,10,\n", "GeneratedTokens", "is empty"),
        ("yesterday,10,4\n", "TIMESTAMP", "is not a datetime ('yesterday')"),
        ("2023-11-16 18:15:47.0000000,1e30,44\n", "ContextTokens", "is too large (1e+30)"),
    ],
)
def test_bad_csv_cell_names_file_line_and_field(tmp_path: Path, row: str, field: str, message: str) -> None:
    path = write(tmp_path, "a.csv", AZURE_HEADER + OK_AZURE_ROW + OK_AZURE_ROW + row + OK_AZURE_ROW)
    err = error_of(path)
    assert (err.path, err.line, err.field) == (str(path), 4, field)
    assert str(err) == f"{path}, line 4, field '{field}': {message}"


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]', None, "malformed JSON"),
        ("[1, 2, 3]", None, "is not a JSON object"),
        (mooncake_row(0, 1025, 3, [0, 1]).strip(), "hash_ids",
         "count does not match ceil(prompt tokens / 512) (2 ids for 1025 tokens, expected 3)"),
        (mooncake_row(0, 10, 3, [0.5]).strip(), "hash_ids", "is not a list of integers ([0.5])"),
        (mooncake_row(0, 10, None, [0]).strip(), "output_length", "is null"),
        (mooncake_row(0, "ten", 1, [0]).strip(), "input_length", "is not a number ('ten')"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [0]}', "output_length", "is missing"),
    ],
)
def test_bad_jsonl_line_names_file_line_and_field(tmp_path: Path, line: str, field: str | None, message: str) -> None:
    good = mooncake_row(0, 10, 1, [0])
    path = write(tmp_path, "m.jsonl", good + "\n" + good + line + "\n" + good)
    err = error_of(path, format="mooncake")
    assert (err.line, err.field) == (4, field)  # blank line 2 still counts
    assert err.message.startswith(message)


def test_earliest_bad_row_is_reported(tmp_path: Path) -> None:
    rows = ["2023-11-16 18:15:47.0000000,10,-1\n", "2023-11-16 18:15:48.0000000,x,1\n"]
    err = error_of(write(tmp_path, "a.csv", AZURE_HEADER + "".join(rows)))
    assert (err.line, err.field) == (2, "GeneratedTokens")


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("", 1, "file is empty"),
        ("\n  \n", 1, "file is empty"),
        (AZURE_HEADER, 2, "no data rows after the header"),
    ],
)
def test_empty_inputs(tmp_path: Path, text: str, line: int, message: str) -> None:
    err = error_of(write(tmp_path, "e.csv", text), format="azure")
    assert (err.line, err.message) == (line, message)


def test_undetectable_json_first_line(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "l.jsonl", "[1, 2]\n"))
    assert (err.line, err.message) == (1, "the first JSON line is not an object")


def test_missing_column_names_it(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:47,1\n"), format="azure")
    assert (err.line, err.field) == (1, "GeneratedTokens")
    assert err.message.startswith("missing column")


def test_row_with_wrong_field_count(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "a.csv", AZURE_HEADER + OK_AZURE_ROW + "2023-11-16 18:15:47,1,2,3\n"))
    assert (err.line, err.field, err.message) == (3, None, "has 4 fields where the header has 3")


def test_non_utf8_bytes(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "a.csv", (AZURE_HEADER + OK_AZURE_ROW).encode() + b"\xff\xfe,1,2\n"))
    assert (err.line, err.message) == (3, "not UTF-8 text")


def test_skip_bad_counts_rows_by_reason(tmp_path: Path) -> None:
    good = mooncake_row(0, 600, 5, [0, 1])
    text = (
        good
        + mooncake_row(3000, 600, 0, [0, 1])  # output 0
        + "{broken\n"
        + mooncake_row(6000, 600, 0, [0, 1])  # output 0 again
        + mooncake_row(6000, 1025, 5, [0, 1])  # hash count
        + mooncake_row(9000, 100, 5, [0])
    )
    t = traces.load(write(tmp_path, "m.jsonl", text), skip_bad=True)
    assert t.prompt_tokens.tolist() == [600, 100]
    assert t.notes == (
        "skipped 2 bad rows: output_length is zero (must be >= 1) (first at line 2)",
        "skipped 1 bad row: malformed JSON (first at line 3)",
        "skipped 1 bad row: hash_ids count does not match ceil(prompt tokens / 512) (first at line 5)",
    )


def test_skip_bad_with_nothing_left_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:15:47,-1,1\n")
    err = error_of(path, skip_bad=True)
    assert err.message.startswith("no valid rows (skipped 1 bad row: ContextTokens is negative")


def test_canonical_header_and_row_count_are_checked(tmp_path: Path) -> None:
    header = ('{"format": "kvsim-trace", "version": 1, "rows": 2, "source": "x", "hash_block_size": null, '
              '"columns": ["arrival_s", "prompt_tokens", "output_tokens"], "notes": []}\n')
    row = '{"arrival_s": 0.0, "prompt_tokens": 3, "output_tokens": 1}\n'
    err = error_of(write(tmp_path, "c.jsonl", header + row))
    assert (err.line, err.field) == (1, "rows") and "promises 2 rows but the file has 1" in err.message
    err = error_of(write(tmp_path, "c.jsonl", header.replace('"version": 1', '"version": 9') + row + row))
    assert (err.line, err.field) == (1, "version")
    err = error_of(write(tmp_path, "c.jsonl", header.replace('"hash_block_size": null', '"hash_block_size": 16') + row + row))
    assert err.field == "hash_block_size"
    without_key = header.replace('"hash_block_size": null, ', "")  # optional when there are no prefix hashes
    assert len(traces.load(write(tmp_path, "c.jsonl", without_key + row + row))) == 2
    err = error_of(write(tmp_path, "c.jsonl", header + row + row.replace("3", "3.5")))
    assert (err.line, err.field, err.message) == (3, "prompt_tokens", "is not a 64-bit integer (3.5)")
