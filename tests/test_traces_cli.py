"""``kvsim trace`` through click's CliRunner: output, files written, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvsim import traces
from kvsim.cli.main import main as kvsim
from kvsim.cli.trace import trace

STATS_KEYS = {"rows", "duration_s", "rate_rps", "interarrival_cv", "prompt_tokens", "output_tokens", "prefix_reuse_bound"}


def run(*args: str):
    return CliRunner().invoke(trace, list(args), catch_exceptions=False)


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


def test_info_json_has_exactly_the_documented_keys() -> None:
    result = run("info", str(traces.bundled("mooncake_500")), "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert STATS_KEYS <= set(data) <= STATS_KEYS | {"source", "notes"}
    assert set(data["prompt_tokens"]) == {"mean", "p50", "p90", "p99", "max"}
    expected = traces.stats(traces.load(traces.bundled("mooncake_500")))
    assert data["rows"] == 500 and data["prefix_reuse_bound"] == expected.prefix_reuse_bound
    assert data["prompt_tokens"]["mean"] == expected.prompt_tokens.mean


def test_info_text_and_bundled_names_through_the_root_cli() -> None:
    result = CliRunner().invoke(kvsim, ["trace", "info", "azure_conv_10min"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "rows                2,867" in result.output
    assert "prefix reuse bound  n/a (no prefix hashes)" in result.output
    data = json.loads(run("info", "azure_conv_10min", "--json").output)
    assert data["prefix_reuse_bound"] is None


def test_info_with_mapping_and_skip_bad_prints_the_counts(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("ts,in,out\n0,10,1\n500,-3,1\n1000,20,0\n2000,30,2\n")
    result = run("info", str(path), "--map", "arrival=ts,prompt=in", "--map", "output=out", "--time-unit", "ms", "--skip-bad")
    assert result.exit_code == 0
    assert "rows                2" in result.output
    assert "note: skipped 1 bad row: in is negative (first at line 3)" in result.output
    assert "note: skipped 1 bad row: out is zero (must be >= 1) (first at line 4)" in result.output
    assert_one_line_error(run("info", str(path), "--map", "arrival=ts,prompt=in,output=out"), "x.csv, line 3, field 'in'")


def test_synth_is_deterministic_and_loadable(tmp_path: Path) -> None:
    args = ["synth", "--rate", "3", "--count", "50", "--arrival", "gamma", "--cv", "2", "--prompt", "uniform:50,100",
            "--output", "fixed:8", "--system-prompt", "32", "--turns", "2", "--samples", "2", "--seed", "4"]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run(*args, "--out", str(first)).exit_code == 0
    assert run(*args, "--out", str(second)).exit_code == 0
    assert first.read_bytes() == second.read_bytes()
    t = traces.load(first)
    assert len(t) == 50 and t.n_samples.tolist() == [2] * 50 and t.hash_block_size == 16
    assert set(t.output_tokens.tolist()) == {8}


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--rate", "1"], "exactly one of --duration and --count"),
        (["--rate", "1", "--count", "5", "--cv", "2"], "--cv goes with --arrival gamma"),
        (["--rate", "1", "--count", "5", "--prompt", "zipf:1"], "bad length spec 'zipf:1'"),
        (["--rate", "-1", "--count", "5"], "rate must be > 0"),
    ],
)
def test_synth_errors(tmp_path: Path, args: list[str], fragment: str) -> None:
    assert_one_line_error(run("synth", "--out", str(tmp_path / "x.jsonl"), *args), fragment)


def test_convert_applies_transforms_in_order(tmp_path: Path) -> None:
    out = tmp_path / "c.jsonl"
    result = run("convert", "mooncake_500", str(out), "--spread-buckets", "--window", "30:90", "--first", "100",
                 "--sample", "50", "--seed", "1", "--scale-rate", "2", "--shrink-lengths", "8", "--clamp", "2048")
    assert result.exit_code == 0, result.output
    assert "wrote 50 requests" in result.output
    t = traces.load(out)
    expected = traces.bundled("mooncake_500")
    e = traces.spread_buckets(traces.load(expected))
    e = traces.sample(traces.first(traces.window(e, 30, 90), 100), 50, 1)
    e = traces.clamp(traces.shrink_lengths(traces.scale_rate(e, 2), 8), 2048)
    assert t.equals(e)
    assert t.hash_block_size == 64 and max(t.prompt_tokens + t.output_tokens) <= 2048


def test_convert_from_azure_round_trips_through_canonical(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    assert run("convert", str(traces.bundled("azure_conv_10min")), str(out), "--format", "azure").exit_code == 0
    assert traces.load(out).equals(traces.load(traces.bundled("azure_conv_10min")))


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["missing.csv"], "No such file or directory: missing.csv"),
        (["demo", "--window", "5"], "expected START:END"),
        (["demo", "--window", "500:600"], "no requests left"),
        (["demo", "--shrink-lengths", "5"], "does not divide"),
        (["demo", "--map", "arrival"], "expected COL=NAME"),
        (["demo", "--format", "azure"], "missing column"),
    ],
)
def test_convert_errors_are_one_line(tmp_path: Path, args: list[str], fragment: str) -> None:
    source, *rest = args
    assert_one_line_error(run("convert", source, str(tmp_path / "o.jsonl"), *rest), fragment)


def test_info_errors_are_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line_error(run("info", str(empty)), "empty.jsonl, line 1: file is empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}\n')
    assert_one_line_error(run("info", str(bad)), "bad.jsonl, line 1, field 'hash_ids': count does not match")
