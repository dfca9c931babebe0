"""The real traces in ../shared/traces: `kvsim trace info` reproduces their README's table."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvsim import traces
from kvsim.cli.trace import trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"

pytestmark = pytest.mark.shared

# ../shared/traces/README.md, as printed there: rows, span s, rate, input mean/p50/p99,
# output mean/p50/p99, inter-arrival CV, prefix reuse bound %
TABLE = {
    "azure_llm_2023/AzureLLMInferenceTrace_code.csv":
        ("8819", "3436", "2.57", ("2048", "1469", "7436"), ("27.9", "13", "252"), "13.2", None),
    "azure_llm_2023/AzureLLMInferenceTrace_conv.csv":
        ("19366", "3502", "5.53", ("1155", "1020", "4142"), ("211", "129", "601"), "1.09", None),
    "mooncake_fast25/conversation_trace.jsonl": ("12031", "3537", "3.40", ("12035", "6909", "85400"), ("343", "350", "1119"), None, "37.4"),
}


def printed_as(value: float, text: str) -> bool:
    """``value`` rounds to ``text`` at the precision ``text`` is printed with."""
    decimals = len(text.partition(".")[2])
    return f"{value:.{decimals}f}" == text


def shared(name: str) -> Path:
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"{path} is not available")
    return path


@pytest.mark.parametrize("name", sorted(TABLE))
def test_trace_info_reproduces_the_readme_table(name: str) -> None:
    rows, span, rate, prompt, output, cv, reuse = TABLE[name]
    result = CliRunner().invoke(trace, ["info", str(shared(name)), "--json"], catch_exceptions=False)
    assert result.exit_code == 0
    s = json.loads(result.output)
    assert str(s["rows"]) == rows
    assert printed_as(s["duration_s"], span) and printed_as(s["rate_rps"], rate)
    for got, (mean, p50, p99) in ((s["prompt_tokens"], prompt), (s["output_tokens"], output)):
        assert printed_as(got["mean"], mean) and printed_as(got["p50"], p50)
        # numpy's linear percentile; the README's p99 of code outputs (252) used another rule (251.46 here)
        assert got["p99"] == pytest.approx(float(p99), abs=1.0)
    assert s["interarrival_cv"] is not None and (cv is None or printed_as(s["interarrival_cv"], cv))
    if reuse is None:
        assert s["prefix_reuse_bound"] is None
    else:
        assert printed_as(100 * s["prefix_reuse_bound"], reuse)


def test_mooncake_is_on_a_three_second_grid() -> None:
    t = traces.load(shared("mooncake_fast25/conversation_trace.jsonl"))
    assert any("share 1180 distinct timestamps" in note for note in t.notes)
    spread = traces.spread_buckets(t)
    assert spread.notes[-1] == "timestamp buckets spread over 3 s"
    assert traces.stats(spread).interarrival_cv < traces.stats(t).interarrival_cv


@pytest.mark.parametrize("name", ["azure_llm_2023/AzureLLMInferenceTrace_conv.csv", "mooncake_fast25/conversation_trace.jsonl"])
def test_whole_traces_load_well_under_a_second(name: str) -> None:
    path = shared(name)
    best = min(_timed_load(path) for _ in range(2))
    assert best < 1.0


def _timed_load(path: Path) -> float:
    start = time.perf_counter()
    traces.load(path)
    return time.perf_counter() - start
