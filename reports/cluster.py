"""The page of a cluster run (``kvsim simulate --instances N``): load per instance, instances over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import plotly.graph_objects as go

from kvsim.reports.figures import palette, series_data, styled
from kvsim.reports.page import Page
from kvsim.reports.runs import ReportInputError, read_columns, read_json


def cluster_page(run_dir: Path) -> Page:
    summary = read_json(run_dir / "summary.json")
    if not isinstance(summary, dict) or "instances" not in summary or "router" not in summary:
        raise ReportInputError(f"{run_dir / 'summary.json'}: not a cluster run (no instances / router; kvsim simulate --instances N)")
    steps = read_columns(run_dir / "steps.csv", ("start_s", "duration_s", "kv_used", "instance"))
    instances = summary["instances"]
    names = [f"instance {s['instance']}" for s in instances]
    colors = palette(names)
    router = summary["router"]
    page = Page("kvsim cluster run")
    page.note(f"{router['instances']} instances behind {router['name']}; {summary['requests_completed']} requests completed, "
              f"prefix hit rate {100 * summary['prefix_hit_rate']:.1f} %, {summary['instance_seconds']:.0f} instance-seconds.")
    page.figure(_load(instances, names, colors))
    page.figure(_kv_over_time(steps, instances, names, colors))
    if len(summary["instances_over_time"]) > 1:
        page.figure(_instance_count(summary["instances_over_time"], summary["duration_s"]))
    page.table(["instance", "requests routed", "completed", "prefix hit rate (%)", "KV blocks", "peak used", "p99 TTFT (s)"],
               [[name, str(s["requests_routed"]), str(s["requests_completed"]), f"{100 * s['prefix_hit_rate']:.1f}",
                 str(s["num_kv_blocks"]), str(s["peak_kv_blocks_used"]), f"{s['ttft_s']['p99'] or 0:.3f}"]
                for name, s in zip(names, instances)])
    return page


def _load(instances: list[dict], names: list[str], colors: dict[str, str]) -> go.Figure:
    fig = go.Figure(go.Bar(x=names, y=[s["requests_routed"] for s in instances], marker={"color": [colors[n] for n in names]},
                           text=[f"{100 * s['prefix_hit_rate']:.1f} % cached" for s in instances], textposition="outside"))
    return styled(fig, "Requests routed to each instance (label: its prefix hit rate)", yaxis_title="requests")


def _kv_over_time(steps: dict[str, np.ndarray], instances: list[dict], names: list[str], colors: dict[str, str]) -> go.Figure:
    fig = go.Figure()
    for name, s in zip(names, instances):
        rows = steps["instance"] == s["instance"]
        end = steps["start_s"][rows] + steps["duration_s"][rows]
        data = series_data(end, {"usage": steps["kv_used"][rows] / max(s["num_kv_blocks"], 1)})
        fig.add_trace(go.Scattergl(x=data["t_usage"], y=data["usage"], mode="lines", name=name, line={"color": colors[name]}))
    return styled(fig, "KV-block usage of each instance", xaxis_title="time (s)", yaxis_title="used / total blocks")


def _instance_count(timeline: list[list[float]], duration_s: float) -> go.Figure:
    times = [t for t, _ in timeline] + [duration_s]
    counts = [n for _, n in timeline] + [timeline[-1][1]]
    fig = go.Figure(go.Scatter(x=times, y=counts, mode="lines", line={"shape": "hv"}, name="serving"))
    return styled(fig, "Instances serving over time (the autoscaler's)", xaxis_title="time (s)", yaxis_title="instances")
