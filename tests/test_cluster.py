"""A cluster of instances behind a router: one loop, every request served once, routers that matter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvsim.cli.main import main
from kvsim.sim.cluster.cluster import ClusterSimulation
from kvsim.sim.cluster.routers import ROUTERS, make_router
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import RunConfig, load_run_trace, resolve
from kvsim.sim.run.simulator import simulate

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MOONCAKE = RunConfig(trace="mooncake_500", model="qwen2.5-7b", max_model_len=32768)


def _cluster(config: RunConfig, instances: int, router: str, staleness_s: float = 0.0):
    resolved = resolve(config)
    timers = [CostModelTimer(resolved.cost_model()) for _ in range(instances)]
    return ClusterSimulation(load_run_trace(config), resolved, timers, make_router(router), staleness_s).run()


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_one_instance_behind_any_router_is_the_single_engine_run(router: str) -> None:
    config = RunConfig(max_requests=60, num_blocks=60, block_size=16, max_model_len=960, rate_scale=4.0)  # preemptions happen
    resolved = resolve(config)
    single = simulate(load_run_trace(config), resolved.new_engine(), CostModelTimer(resolved.cost_model()))
    (cluster,) = _cluster(config, 1, router).runs
    assert cluster.records.requests.tuples() == single.records.requests.tuples()
    assert cluster.steps.rows() == single.steps.rows()
    assert sum(r.num_preemptions for r in single.requests) > 0


def test_every_request_is_served_once_across_the_instances() -> None:
    run = _cluster(MOONCAKE, 4, "kv-aware")
    rows = [r.trace_index for one in run.runs for r in one.requests if r.parent is None]
    assert sorted(rows) == list(range(500)) and (run.placement >= 0).all()
    for i, one in enumerate(run.runs):
        assert all(run.placement[r.trace_index] == i for r in one.requests if r.parent is None)
    summary = run.summary()
    assert summary["requests_completed"] + summary["requests_rejected"] == 500
    assert sum(s["requests_routed"] for s in summary["instances"]) == 500
    assert summary["num_kv_blocks"] == sum(one.engine.config.num_blocks for one in run.runs)


def test_kv_aware_routing_finds_more_cached_prefixes_than_round_robin() -> None:
    hits = {router: _cluster(MOONCAKE, 4, router).summary()["prefix_hit_rate"] for router in ("round-robin", "kv-aware")}
    assert hits["kv-aware"] > 1.2 * hits["round-robin"] > 0


def test_a_stale_view_sends_everything_where_it_last_looked_empty() -> None:
    """What users of cache-aware routers report: a view that is never refreshed. The router's own
    counters (least-requests) stay current; the scraped KV usage (least-kv) does not."""
    config = MOONCAKE.updated(max_requests=80)
    stale = _cluster(config, 3, "least-kv", staleness_s=1e9).placement
    assert (stale == 0).all()
    counted = _cluster(config, 3, "least-requests", staleness_s=1e9).placement
    assert len(set(counted.tolist())) == 3


def test_cluster_run_directory_and_a_user_router(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    args = ["simulate", "--trace", "mooncake_500", "--model", "qwen2.5-7b", "--max-model-len", "32768", "--instances", "3",
            "--router", "first_block_router:FirstBlockRouter", "--max-requests", "60", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Cluster: 3 instances behind first_block_router:FirstBlockRouter" in result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["router"]["instances"] == 3 and len(summary["instances"]) == 3
    header = (tmp_path / "run" / "requests.csv").read_text().splitlines()[0]
    assert header.endswith(",instance")
    assert all((tmp_path / "run" / "instances" / str(i) / "decisions.digest.json").exists() for i in range(3))
    assert len((EXAMPLES / "first_block_router.py").read_text().splitlines()) < 40
    page = CliRunner().invoke(main, ["report", "cluster", str(tmp_path / "run"), "--out", str(tmp_path / "page.html")])
    assert page.exit_code == 0, page.output
    assert "instance 2" in (tmp_path / "page.html").read_text()
    single = CliRunner().invoke(main, ["simulate", "--max-requests", "3", "--quiet", "--out", str(tmp_path / "one")])
    assert single.exit_code == 0
    refused = CliRunner().invoke(main, ["report", "cluster", str(tmp_path / "one"), "--out", str(tmp_path / "x.html")])
    assert refused.exit_code == 2 and "not a cluster run" in refused.output


def test_a_router_that_raises_is_one_line_exit_2(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "bad_router.py").write_text("class Bad:\n    def choose(self, request, view):\n        raise KeyError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["simulate", "--instances", "2", "--router", "bad_router:Bad", "--max-requests", "5", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "router Bad raised KeyError" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def _scaled(tmp_path: Path, toml: str, rate: str, requests: int = 0) -> dict:
    (tmp_path / "run.toml").write_text(toml)
    args = ["simulate", "--config", str(tmp_path / "run.toml"), "--trace", "azure_conv_10min", "--model", "llama-2-7b",
            "--request-rate", rate, "--max-requests", str(requests), "--decisions", "off", "--quiet", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def test_an_overloaded_cluster_scales_up_after_a_cold_start(tmp_path: Path) -> None:
    summary = _scaled(tmp_path, 'autoscaler = "kv-utilization"\n[autoscaler_params]\nmax_instances = 3\n', "20")
    timeline, scaling = summary["instances_over_time"], summary["autoscaler"]
    assert scaling["launched"] == 2 and [n for _, n in timeline] == [1, 2, 3]
    cold = scaling["cold_start_s"]
    assert cold == pytest.approx(summary["memory"]["weight_bytes"] / 2e9)  # Llama-2-7B's weights read at 2 GB/s
    assert all(t >= 10.0 + cold - 1e-9 for t, _ in timeline[1:])  # a decision every 10 s, then the cold start
    assert summary["instance_seconds"] < 3 * summary["duration_s"]


def test_an_idle_cluster_scales_down_to_its_minimum(tmp_path: Path) -> None:
    toml = 'autoscaler = "queue"\ninstances = 4\n[autoscaler_params]\nmin_instances = 1\nmax_instances = 4\nper_instance = 8\n'
    summary = _scaled(tmp_path, toml, "1", requests=400)
    assert summary["autoscaler"]["retired"] == 3 and summary["instances_over_time"][-1][1] == 1
    assert summary["requests_completed"] + summary["requests_rejected"] == 400
    assert summary["instance_seconds"] < 1.1 * summary["duration_s"] + 60  # three of four leave within a minute
