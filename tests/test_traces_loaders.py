"""Loaders: every format from small inline files, detection, and the canonical round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim import traces
from kvsim.traces import Ragged, Trace


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:50.9951691,879,3
2023-11-16 23:59:59.9999999,12,1
2023-11-17 00:00:00.0000001,5,7
"""

MOONCAKE = """{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}
{"timestamp": 0, "input_length": 512, "output_length": 20, "hash_ids": [0]}
{"timestamp": 3000, "input_length": 1025, "output_length": 30, "hash_ids": [0, 1, 2]}
{"timestamp": 3000, "input_length": 1, "output_length": 1, "hash_ids": [9]}
"""


def test_azure_datetimes_are_parsed_exactly(tmp_path: Path) -> None:
    t = traces.load(write(tmp_path, "a.csv", AZURE))
    assert traces.detect_format(tmp_path / "a.csv") == "azure"
    # 100 ns ticks survive: 4.3145790 s, one tick later, and a midnight crossing
    assert t.arrival_s.tolist() == [0.0, 4.314579, 4.3145791, 20653.3194099, 20653.3194101]
    assert t.prompt_tokens.tolist() == [374, 396, 879, 12, 5]
    assert t.output_tokens.tolist() == [44, 109, 3, 1, 7]
    assert t.prompt_tokens.dtype == np.int64 and t.arrival_s.dtype == np.float64
    assert t.prefix_hashes is None and t.source == "a.csv (azure)" and t.notes == ()


def test_mooncake_rows_hashes_and_grid_note(tmp_path: Path) -> None:
    t = traces.load(write(tmp_path, "m.jsonl", MOONCAKE))
    assert t.arrival_s.tolist() == [0.0, 0.0, 3.0, 3.0]
    assert t.prompt_tokens.tolist() == [1000, 512, 1025, 1]
    assert t.hash_block_size == 512
    assert t.prefix_hashes.to_rows() == [[0, 1], [0], [0, 1, 2], [9]]
    assert t.hashes_of(2).tolist() == [0, 1, 2]
    assert t.notes == (
        "4 requests share 2 distinct timestamps: each group arrives as one burst "
        "(spread_buckets / --spread-buckets spreads them)",
    )


def test_mooncake_without_hash_ids_has_no_hashes(tmp_path: Path) -> None:
    path = write(tmp_path, "m.jsonl", '{"timestamp": 5, "input_length": 7, "output_length": 2}\n' * 2)
    t = traces.load(path)
    assert t.prefix_hashes is None and t.hash_block_size is None and len(t) == 2


def test_splitwise_vidur_csv(tmp_path: Path) -> None:
    path = write(tmp_path, "s.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,100,10\n1.25,200,20\n")
    t = traces.load(path)
    assert traces.detect_format(path) == "splitwise"
    assert t.arrival_s.tolist() == [0.0, 0.75]
    assert t.output_tokens.tolist() == [10, 20]
    assert traces.load(path, "vidur").arrival_s.tolist() == [0.0, 0.75]


def test_burstgpt_leaves_out_failures_and_counts_them(tmp_path: Path) -> None:
    text = (
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,GPT-4,1087,0,1087,Conversation log\n"
        "118,GPT-4,0,0,0,API log\n"
        "185,ChatGPT,1360,647,2007,Conversation log\n"
    )
    t = traces.load(write(tmp_path, "b.csv", text))
    assert t.arrival_s.tolist() == [0.0, 180.0]
    assert t.prompt_tokens.tolist() == [472, 1360]
    assert t.notes == ("left out 2 failed requests (Response tokens = 0 is BurstGPT's mark of a failure)",)


def test_burstgpt_session_ids_become_codes(tmp_path: Path) -> None:
    text = (
        "Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "1,abc,ChatGPT,10,5,15,Conversation log\n2,xyz,ChatGPT,10,5,15,Conversation log\n"
        "3,abc,ChatGPT,30,5,35,Conversation log\n"
    )
    t = traces.load(write(tmp_path, "b.csv", text))
    assert t.session_id.tolist() == [0, 1, 0]


def test_generic_csv_with_mapping_units_and_hash_lists(tmp_path: Path) -> None:
    text = 'ts,in,out,h,conv\n1500,40,3,"[7, 8, 9]",a\n1000,20,5,7 8,b\n'
    path = write(tmp_path, "g.csv", text)
    t = traces.load(
        path,
        columns={"arrival": "ts", "prompt": "in", "output": "out", "hashes": "h", "session": "conv"},
        time_unit="ms",
        hash_block_size=16,
    )
    assert t.arrival_s.tolist() == [0.0, 0.5]  # sorted: the row at 1000 ms comes first
    assert t.prompt_tokens.tolist() == [20, 40]
    assert t.prefix_hashes.to_rows() == [[7, 8], [7, 8, 9]]
    assert t.session_id.tolist() == [1, 0]  # labels numbered by first appearance in the file
    assert any("sorted by arrival time: 1 rows" in n for n in t.notes)
    assert t.source == "g.csv (csv)"


def test_generic_jsonl_with_datetimes_priority_and_samples(tmp_path: Path) -> None:
    text = (
        '{"t": "2024-01-01T00:00:00", "p": 10, "o": 2, "prio": 1, "n": 2}\n'
        '{"t": "2024-01-01T00:00:01.25", "p": 11, "o": 3, "prio": 0, "n": 1}\n'
    )
    t = traces.load(
        write(tmp_path, "g.jsonl", text),
        columns={"arrival": "t", "prompt": "p", "output": "o", "priority": "prio", "n": "n"},
        time_unit="datetime",
    )
    assert t.arrival_s.tolist() == [0.0, 1.25]
    assert t.priority.tolist() == [1, 0] and t.priority_of(0) == 1
    assert t.n_samples.tolist() == [2, 1] and t.n_samples_of(1) == 1


def test_unsorted_rows_are_sorted_stably_and_reported(tmp_path: Path) -> None:
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n2,1,1\n1,2,1\n2,3,1\n1,4,1\n0,5,1\n"
    t = traces.load(write(tmp_path, "s.csv", text))
    assert t.prompt_tokens.tolist() == [5, 2, 4, 1, 3]  # ties keep file order
    assert t.arrival_s.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0]
    assert t.notes == ("sorted by arrival time: 3 rows arrived earlier than the row before them",)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("a.txt", AZURE, "azure"),
        ("x.csv", MOONCAKE, "mooncake"),  # content decides, not the extension
        ("s", "arrived_at,num_prefill_tokens,num_decode_tokens,extra\n1,2,3,4\n", "splitwise"),
        ("b", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,1,2,3,x\n", "burstgpt"),
    ],
)
def test_detection_by_content(tmp_path: Path, name: str, text: str, expected: str) -> None:
    assert traces.detect_format(write(tmp_path, name, text)) == expected


def test_detection_failure_names_the_columns(tmp_path: Path) -> None:
    path = write(tmp_path, "u.csv", "a,b,c\n1,2,3\n")
    with pytest.raises(traces.TraceFormatError, match=r"u.csv, line 1: unrecognised CSV columns \['a', 'b', 'c'\]"):
        traces.load(path)
    with pytest.raises(ValueError, match="needs a column mapping"):
        traces.load(path, "csv")
    assert len(traces.load(path, columns={"arrival": "a", "prompt": "b", "output": "c"})) == 1


def test_options_that_do_not_apply_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "a.csv", AZURE)
    with pytest.raises(ValueError, match="fixed columns"):
        traces.load(path, "azure", time_unit="ms")
    with pytest.raises(ValueError, match="unknown format"):
        traces.load(path, "parquet")
    with pytest.raises(ValueError, match="unknown column 'arrivals'"):
        traces.load(path, columns={"arrivals": "TIMESTAMP", "prompt": "ContextTokens", "output": "GeneratedTokens"})
    with pytest.raises(ValueError, match="needs output"):
        traces.load(path, columns={"arrival": "TIMESTAMP", "prompt": "ContextTokens"})
    with pytest.raises(ValueError, match="hash_block_size"):
        traces.load(path, columns={"arrival": "TIMESTAMP", "prompt": "ContextTokens", "output": "GeneratedTokens", "hashes": "x"})


# ------------------------------------------------------------------ canonical round trip


def _full_trace() -> Trace:
    base = traces.synthesize(
        rate=3.0, n_requests=60, system_prompt_tokens=40, turns=3, think_time_s=2.0, n_samples=2, hash_block_size=16,
        prompt=traces.LogNormal(80, 1.0), output=traces.Uniform(1, 30), seed=7,
    )
    rng = np.random.default_rng(1)
    return Trace(
        arrival_s=base.arrival_s,
        prompt_tokens=base.prompt_tokens,
        output_tokens=base.output_tokens,
        source=base.source,
        prefix_hashes=base.prefix_hashes,
        hash_block_size=base.hash_block_size,
        token_ids=Ragged.from_rows([rng.integers(-(2**63), 2**63 - 1, size=p) for p in base.prompt_tokens]),
        session_id=base.session_id,
        priority=rng.integers(-3, 3, size=len(base)),
        n_samples=base.n_samples,
        notes=("made for a test", "ünïcode note"),
    )


def test_canonical_round_trip_is_exact(tmp_path: Path) -> None:
    trace = _full_trace()
    path = traces.save(trace, tmp_path / "t.jsonl")
    assert traces.detect_format(path) == "kvsim"
    again = traces.load(path)
    assert again.equals(trace)
    assert again.arrival_s.tobytes() == trace.arrival_s.tobytes()
    traces.save(again, tmp_path / "u.jsonl")
    assert (tmp_path / "u.jsonl").read_bytes() == path.read_bytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gaps=st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False), min_size=0, max_size=20),
    block=st.integers(1, 64),
)
def test_canonical_round_trip_any_floats(tmp_path: Path, gaps: list[float], block: int) -> None:
    arrival = np.concatenate([[0.0], np.cumsum(gaps)])
    prompt = np.arange(1, len(arrival) + 1, dtype=np.int64) * 7
    trace = Trace(
        arrival_s=arrival,
        prompt_tokens=prompt,
        output_tokens=np.ones(len(arrival), dtype=np.int64),
        prefix_hashes=Ragged.from_rows([list(range(-(-p // block))) for p in prompt.tolist()]),
        hash_block_size=block,
    )
    path = traces.save(trace, tmp_path / "h.jsonl")
    assert traces.load(path).equals(trace)


def test_save_refuses_a_trace_that_breaks_the_schema(tmp_path: Path) -> None:
    bad = Trace(np.array([1.0, 2.0]), np.array([1, 1]), np.array([1, 1]))
    with pytest.raises(ValueError, match="start at 0"):
        traces.save(bad, tmp_path / "x.jsonl")
    bad = Trace(np.array([0.0]), np.array([100]), np.array([1]), prefix_hashes=Ragged.from_rows([[1]]), hash_block_size=16)
    with pytest.raises(ValueError, match="ceil"):
        traces.save(bad, tmp_path / "x.jsonl")


def test_ragged_take_gathers_rows() -> None:
    r = Ragged.from_rows([[1, 2], [3], [], [4, 5, 6]])
    assert r.take(np.array([3, 0, 2, 0])).to_rows() == [[4, 5, 6], [1, 2], [], [1, 2]]
    assert r.take(np.array([], dtype=np.int64)).to_rows() == []
