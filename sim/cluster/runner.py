"""A cluster run's directory: the cluster's files as a single run writes them, instances beside.

``summary.json`` (the cluster's figures, ``instances`` and ``router`` within), ``requests.csv``
with an ``instance`` column, ``steps.csv`` with one too (every instance's steps, by end time);
``instances/<i>/`` holds each instance's decision digest (or log) when one is asked for.
"""

from __future__ import annotations

import csv
from pathlib import Path

from kvsim.sim.cluster.cluster import ClusterRun, ClusterSimulation
from kvsim.sim.cluster.routers import Router
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.decisions import DecisionLog
from kvsim.sim.run.metrics import REQUEST_COLUMNS, STEP_COLUMNS
from kvsim.sim.run.outputs import REQUESTS, STEPS, atomic_open, write_summary
from kvsim.sim.run.run_warnings import run_warnings
from kvsim.sim.run.simulator import SimOptions
from kvsim.traces.schema import Trace


def run_cluster(resolved: ResolvedRun, trace: Trace, instances: int, router: Router, router_name: str, out_dir: Path | None,
                *, staleness_s: float = 0.0, check: bool = False, decisions: str = "summary") -> tuple[ClusterRun, dict]:
    """``instances`` copies of the resolved engine behind ``router``; with ``out_dir``, its files."""
    logs = []
    if out_dir is not None and decisions != "off":
        for i in range(instances):
            (out_dir / "instances" / str(i)).mkdir(parents=True, exist_ok=True)
            logs.append(DecisionLog(decisions, resolved.engine_config.block_size, out_dir / "instances" / str(i)))
    options = [SimOptions(check=check, decisions=logs[i] if logs else None) for i in range(instances)]
    timers = [CostModelTimer(resolved.cost_model()) for _ in range(instances)]
    try:
        run = ClusterSimulation(trace, resolved, timers, router, staleness_s, options).run()
    finally:
        for log in logs:
            log.close()
    summary = run.summary()
    summary["trace"] = {"source": trace.source, "rows": len(trace), "notes": list(trace.notes)}
    summary["router"] = {"name": router_name, "instances": instances, "staleness_s": staleness_s}
    summary["config"] = resolved.to_dict()
    summary["memory"] = resolved.memory.to_dict()  # each instance's
    requests = [r for one in run.runs for r in one.requests]
    first = {}
    for one in run.runs:
        first.update(one.times.first_scheduled)
    summary["warnings"] = run_warnings(resolved, trace, summary, requests, first)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_summary(out_dir, summary)
        _write_rows(out_dir / REQUESTS, (*REQUEST_COLUMNS, "instance"), run.request_tuples())
        steps = sorted(((*row, i) for i, one in enumerate(run.runs) for row in one.steps.rows), key=lambda r: r[1] + r[2])
        _write_rows(out_dir / STEPS, (*STEP_COLUMNS, "instance"), steps)
    return run, summary


def _write_rows(path: Path, header: tuple[str, ...], rows: list[tuple]) -> None:
    with atomic_open(path) as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
