"""A cluster's instances dealt out to worker processes (sim/cluster/partitioned.py): the same
decisions on any number of workers, the one loop's where the router reads no state, errors named."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.cli.main import main
from kvsim.sim.cluster import partitioned
from kvsim.sim.cluster.cluster import ClusterRun, ClusterSimulation
from kvsim.sim.cluster.partitioned import Outputs, PartitionedCluster
from kvsim.sim.cluster.routers import make_router
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import RunConfig, load_run_trace, resolve
from kvsim.sim.run.simulator import Simulation

MOONCAKE = RunConfig(trace="mooncake_500", model="qwen2.5-7b", max_model_len=32768, max_requests=300, rate_scale=2.0,
                     instances=4, router_staleness_s=0.5)


def _partitioned(config: RunConfig, router: str, workers: int, outputs: Outputs | None = None) -> ClusterRun:
    return PartitionedCluster(load_run_trace(config), resolve(config), make_router(router), workers,
                              config.router_staleness_s, outputs).run()


def _served(run: ClusterRun) -> list:
    """Every instance's requests and steps, as requests.csv and steps.csv hold them."""
    return [(one.requests.tuples(), one.steps.rows()) for one in run.records]


def test_any_number_of_workers_makes_the_same_decisions(tmp_path: Path) -> None:
    """kv-aware reads the scraped view, its in-flight counters and its prefix index: all three must
    reach the router alike however the instances are dealt out (3 workers: shares of 2, 1, 1)."""
    runs = {w: _partitioned(MOONCAKE, "kv-aware", w, Outputs(decisions="full", out_dir=tmp_path / str(w))) for w in (1, 2, 3)}
    for w in (2, 3):
        assert np.array_equal(runs[w].placement, runs[1].placement)
        assert _served(runs[w]) == _served(runs[1])
        for i in range(4):
            digest = Path("instances", str(i), "decisions.digest.json")
            assert (tmp_path / str(w) / digest).read_bytes() == (tmp_path / "1" / digest).read_bytes()
    summary = runs[2].summary()
    assert summary["requests_completed"] + summary["requests_rejected"] == 300
    rows = sorted(row for one in runs[2].records for row in one.requests.trace_index[one.requests.is_root].tolist())
    assert rows == list(range(300))
    assert len(set(runs[1].placement.tolist())) == 4 and summary["prefix_hit_rate"] > 0


def test_workers_check_the_engines_invariants_after_every_step() -> None:
    run = _partitioned(MOONCAKE.updated(max_requests=40, num_blocks=400), "kv-aware", 2, Outputs(check=True))
    assert sum(len(one.steps) for one in run.records) > 0


def test_a_router_that_reads_no_state_routes_as_in_one_event_loop() -> None:
    resolved = resolve(MOONCAKE)
    timers = [CostModelTimer(resolved.cost_model()) for _ in range(4)]
    one_loop = ClusterSimulation(load_run_trace(MOONCAKE), resolved, timers, make_router("round-robin"), 0.5).run()
    partitioned = _partitioned(MOONCAKE, "round-robin", 2)
    assert np.array_equal(partitioned.placement, one_loop.placement)
    assert _served(partitioned) == _served(one_loop)
    assert _timeless(partitioned.summary()) == _timeless(one_loop.summary())  # the workers' columns against live engines


def _timeless(summary: dict) -> dict:
    """A cluster summary without its wall-clock times."""
    return {**{k: v for k, v in summary.items() if k != "wall_s"},
            "instances": [{k: v for k, v in one.items() if k != "wall_s"} for one in summary["instances"]]}


def test_the_router_learns_of_ended_requests_at_the_meetings() -> None:
    """With meetings a day apart, least-requests never hears of an end while routing: its counters
    only rise, so it deals requests out in turn. With meetings every 0.1 s it hears of them."""
    config = MOONCAKE.updated(max_requests=120)
    blind = _partitioned(config.updated(router_staleness_s=86400.0), "least-requests", 2).placement
    assert blind.tolist() == [row % 4 for row in range(120)]
    told = _partitioned(config.updated(router_staleness_s=0.1), "least-requests", 2).placement
    assert told.tolist() != blind.tolist()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances=st.integers(1, 4), data=st.data(), num_blocks=st.integers(12, 80),
       router=st.sampled_from(["round-robin", "least-requests", "least-kv", "session", "kv-aware"]),
       interval=st.sampled_from([0.05, 0.7, 30.0]), rate=st.sampled_from([1.0, 8.0]))
def test_random_partitioned_clusters_conserve_requests_and_blocks(instances: int, data, num_blocks: int, router: str,
                                                                  interval: float, rate: float) -> None:
    """Small pools (preemptions), any router, any share of instances a worker: every request ends
    once on the instance it was routed to, every block comes back, and one worker agrees."""
    workers = data.draw(st.integers(1, instances), label="workers")
    config = RunConfig(max_requests=25, num_blocks=num_blocks, block_size=16, max_model_len=960, rate_scale=rate,
                       instances=instances, router_staleness_s=interval)
    run = _partitioned(config, router, workers, Outputs(check=True))
    for i, one in enumerate(run.records):
        assert (run.placement[one.requests.trace_index] == i).all()
        assert one.kv_stats.used == 0
    rows = sorted(row for one in run.records for row in one.requests.trace_index[one.requests.is_root].tolist())
    assert rows == list(range(25))
    summary = run.summary()
    assert summary["requests_completed"] + summary["requests_rejected"] == 25
    if workers > 1:
        alone = _partitioned(config, router, 1)
        assert np.array_equal(alone.placement, run.placement) and _served(alone) == _served(run)


def test_spawned_workers_as_on_platforms_without_fork_make_the_same_decisions(monkeypatch) -> None:
    config = MOONCAKE.updated(max_requests=120)
    forked = _partitioned(config, "kv-aware", 2)
    monkeypatch.setattr(partitioned, "process_context", lambda: multiprocessing.get_context("spawn"))
    spawned = _partitioned(config, "kv-aware", 2)
    assert np.array_equal(spawned.placement, forked.placement) and _served(spawned) == _served(forked)


def test_a_failure_in_a_worker_is_raised_in_the_routers_process(monkeypatch) -> None:
    def broken(self, *args) -> None:
        raise RuntimeError("commit broke")

    monkeypatch.setattr(Simulation, "_commit", broken)  # the forked workers inherit it
    with pytest.raises(RuntimeError, match="commit broke"):
        _partitioned(MOONCAKE.updated(max_requests=20), "round-robin", 2)


def test_a_router_that_raises_beside_workers_is_one_line_exit_2(tmp_path: Path, monkeypatch, capfd) -> None:
    (tmp_path / "bad_router.py").write_text("class Bad:\n    def choose(self, request, view):\n        raise KeyError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["simulate", "--instances", "2", "--router", "bad_router:Bad", "--router-staleness", "1", "--cluster-workers", "2",
            "--max-requests", "5", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "router Bad raised KeyError" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
    out, err = capfd.readouterr()  # what the worker processes wrote, on the file descriptors they share
    assert "Traceback" not in out + err


def test_ray_actors_make_the_same_decisions_as_processes() -> None:
    pytest.importorskip("ray", reason="the ray backend needs kvsim[dist]")
    config = MOONCAKE.updated(max_requests=120)
    resolved, trace = resolve(config), load_run_trace(config)
    on_ray = PartitionedCluster(trace, resolved, make_router("kv-aware"), 2, 0.5, backend="ray").run()
    forked = _partitioned(config, "kv-aware", 2)
    assert np.array_equal(on_ray.placement, forked.placement) and _served(on_ray) == _served(forked)


def test_the_ray_backend_without_ray_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, as where kvsim[dist] is not installed
    args = ["simulate", "--instances", "2", "--router-staleness", "1", "--cluster-workers", "2", "--cluster-backend", "ray",
            "--max-requests", "5", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "pip install 'kvsim[dist]'" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("extra", "named"), [
    (["--cluster-workers", "2"], "router_staleness_s"),
    (["--cluster-workers", "5", "--router-staleness", "1"], "cluster_workers"),
    (["--cluster-workers", "2", "--router-staleness", "1", "--autoscaler", "queue"], "cluster_workers"),
])
def test_workers_without_meetings_or_with_a_changing_cluster_exit_2(tmp_path: Path, extra: list[str], named: str) -> None:
    args = ["simulate", "--instances", "4", "--max-requests", "5", "--out", str(tmp_path / "run"), *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and named in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_simulate_with_workers_writes_the_cluster_run_directory(tmp_path: Path) -> None:
    args = ["simulate", "--trace", "mooncake_500", "--model", "qwen2.5-7b", "--max-model-len", "32768", "--instances", "3",
            "--router", "kv-aware", "--router-staleness", "0.5", "--cluster-workers", "2", "--max-requests", "60",
            "--quiet", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["router"]["cluster_workers"] == 2 and len(summary["instances"]) == 3
    assert sum(s["requests_routed"] for s in summary["instances"]) == 60
    assert all((tmp_path / "run" / "instances" / str(i) / "decisions.digest.json").exists() for i in range(3))
