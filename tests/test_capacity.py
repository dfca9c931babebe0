"""kvsim capacity: the rate it reports meets the SLOs when simulated directly, a rate just above misses,
and stopping an overloaded probe early never changes its answer."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvsim.cli.main import main
from kvsim.policies.plan import PlanDetail
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import RunConfig, load_run_trace, resolve
from kvsim.sim.run.simulator import SimOptions, simulate
from kvsim.sim.studies.capacity import MAX_RANGE, Slo, SloWatch, evaluate, gallop, probe, search

SMALL = 'trace = "azure_conv_10min"\nmax_requests = 200\n'
SLO = Slo(ttft_s=1.5, tpot_s=0.2, percentile=95)


def _p(values, percentile: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), percentile))


def _simulated_latencies(tmp_path, name: str, rate: float) -> tuple[float, float]:
    """p95 TTFT and TPOT of `kvsim simulate --request-rate RATE`, read back from its requests.csv."""
    out = tmp_path / name
    result = CliRunner().invoke(main, ["simulate", "--trace", "azure_conv_10min", "--max-requests", "200", "--block-size", "16",
                                       "--request-rate", repr(rate), "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert {r["reject_reason"] for r in rows} <= {"", "exceeds_max_model_len"}  # never rejected for load
    rows = [r for r in rows if r["status"] == "finished"]
    ttft = [float(r["ttft_s"]) for r in rows]
    tpot = [float(r["tpot_s"]) for r in rows if r["tpot_s"]]
    return _p(ttft, SLO.percentile), _p(tpot, SLO.percentile)


def test_capacity_is_checked_by_direct_simulation(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(SMALL + "[grid]\nblock_size = [16]\n[slo]\nttft_s = 1.5\ntpot_s = 0.2\npercentile = 95\n")
    result = CliRunner().invoke(
        main, ["capacity", str(grid), "--out", str(tmp_path / "cap"), "--jobs", "1", "--tolerance", "0.05", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert "block_size=16" in result.output and "capacity within p95 TTFT <= 1.5 s, TPOT <= 0.2 s" in result.output
    row = next(csv.DictReader((tmp_path / "cap" / "capacity.csv").open()))
    capacity, missed = float(row["capacity_rps"]), float(row["missed_at_rps"])
    assert 0 < capacity < missed <= capacity * 1.05 + 1e-9
    ttft, tpot = _simulated_latencies(tmp_path, "at", capacity)
    assert ttft <= SLO.ttft_s and tpot <= SLO.tpot_s
    ttft, tpot = _simulated_latencies(tmp_path, "above", missed)
    assert ttft > SLO.ttft_s or tpot > SLO.tpot_s
    data = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert data["configs"][0]["capacity_rps"] == capacity
    assert (tmp_path / "cap" / "capacity.html").exists()


@pytest.mark.parametrize("rate", [2.0, 6.0, 20.0])
def test_stopping_early_never_changes_the_answer(rate):
    config = RunConfig(trace="azure_conv_10min", max_requests=200, block_size=16, request_rate=rate)
    resolved = resolve(config)
    run = simulate(load_run_trace(config), resolved.new_engine(), CostModelTimer(resolved.cost_model()), SimOptions())
    full = evaluate(run.records.requests, run.summary(), SLO)
    fast = probe(config, rate, SLO)
    assert fast.met == full.met
    if fast.stopped_early:
        assert not full.met


def test_an_overloaded_probe_stops_early():
    config = RunConfig(trace="azure_conv_10min", max_requests=200, block_size=16)
    assert probe(config, 50.0, SLO).stopped_early


def test_watch_reads_no_block_tables_as_the_cost_model_reads_none():
    """So probes run the engine's leanest plans, as a simulate without a log does."""
    resolved = resolve(RunConfig(trace="demo"))
    timer = CostModelTimer(resolved.cost_model())
    assert SloWatch(timer, SLO, 10).plan_detail is PlanDetail.TOTALS is timer.plan_detail


@pytest.mark.parametrize(("text", "expected"), [
    ("[grid]\nrequest_rate = [1.0, 2.0]\n[slo]\nttft_s = 1.0\n", "do not vary ['request_rate']"),
    ("[slo]\nttft_s = \"fast\"\n", "ttft_s = 'fast': expected a number"),
    ("[slo]\npercentile = 99\n", "at least one SLO"),
    ("[slo]\nttft_s = -1\n", "ttft_s = -1"),
])
def test_capacity_file_mistakes_are_one_line(tmp_path, text, expected):
    grid = tmp_path / "grid.toml"
    grid.write_text(SMALL + text)
    result = CliRunner().invoke(main, ["capacity", str(grid), "--out", str(tmp_path / "cap")])
    assert result.exit_code == 2 and expected in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("threshold", [0.003, 0.7, 1.0, 1.04, 3.3, 950.0])
def test_gallop_brackets_the_threshold_within_tolerance(threshold):
    calls = []

    def meets(rate: float) -> bool:
        calls.append(rate)
        return rate <= threshold

    met, missed = gallop(meets, 1.0, 0.05)
    assert met <= threshold < missed <= met * 1.05
    assert len(calls) <= 16
    assert gallop(lambda rate: True, 2.0, 0.05) == (2.0 * MAX_RANGE, None)
    assert gallop(lambda rate: False, 2.0, 0.05) == (None, 2.0 / MAX_RANGE)



def test_a_clusters_capacity_is_searched_on_the_cluster():
    """Two instances behind a router serve more than one, and the answer is checked on the cluster itself."""
    slo = Slo(ttft_s=3.0, tpot_s=0.2, percentile=90)
    one = RunConfig(trace="azure_conv_10min", max_requests=200, block_size=16)
    two = one.updated(instances=2, router="least-requests")
    single, pair = search("one", {}, one, slo, tolerance=0.05), search("two", {}, two, slo, tolerance=0.05)
    assert single.error == pair.error == ""
    assert pair.capacity_rps > 1.5 * single.capacity_rps
    met, missed = pair.bracket
    assert met == pair.capacity_rps and probe(two, met, slo).met and not probe(two, missed, slo).met
    assert not probe(one, pair.capacity_rps, slo).met  # one instance misses what two serve


def test_every_bundled_capacity_example_loads_and_resolves(monkeypatch):
    """examples/capacity_*.toml as a user runs them, from the repository's root: the file loads and every grid point is
    a configuration kvsim resolves (the DeepSeek DBO study's points with and without the overlap, and the what-if
    device that starts from the 910B3, among them)."""
    from pathlib import Path

    from kvsim.cli.capacity import load_capacity_file

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    examples = sorted((root / "examples").glob("capacity_*.toml"))
    assert len(examples) >= 4
    for path in examples:
        points, _ = load_capacity_file(path, {})
        for _, _, config in points:
            assert resolve(config).cost_model() is not None
    dbo = load_capacity_file(examples[0].parent / "capacity_deepseek_dbo.toml", {})[0]
    assert [config.enable_dbo for _, _, config in dbo] == [False, True]
    devices = [resolve(config).device for _, _, config in load_capacity_file(root / "examples" / "capacity_device_whatif.toml", {})[0]]
    assert [d.name for d in devices] == ["ascend-910b3", "910b3-2x-hbm", "ascend-910c"]
    assert devices[1].hbm_bandwidth == 2 * devices[0].hbm_bandwidth and devices[1].platform == "ascend"
    assert devices[1].operators == devices[0].operators and devices[1].engine == devices[0].engine
