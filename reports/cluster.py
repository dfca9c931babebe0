"""The page of a cluster run (``kvsim simulate --instances N``): load per instance, KV usage and
instances over time; a P/D run's KV transfers; KV tiers' traffic per instance."""

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
    if "pd" in summary:
        _transfers(page, summary["pd"], read_columns(run_dir / "requests.csv", ("arrival_s", "decode_instance", "kv_transfer_s")))
    tiered = [(name, s["kv_tiers"]) for name, s in zip(names, instances) if "kv_tiers" in s]
    if tiered:
        _tier_traffic(page, tiered)
    if "kv_store" in summary:
        store = summary["kv_store"]
        page.note(f"Shared KV store: {store['capacity_blocks']} blocks, {store['blocks_held']} held at the end; "
                  f"{store['blocks_put']} put ({store['bytes_put'] / 1e9:.2f} GB), {store['blocks_read']} read "
                  f"({store['bytes_read'] / 1e9:.2f} GB), {store['blocks_evicted']} evicted.")
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


def _transfers(page: Page, pd: dict, requests: dict[str, np.ndarray]) -> None:
    """Each prompt's KV on its way to a decode instance: from the prefill's end to its arrival."""
    delay, exposed = pd["delay_s"], pd["exposed_s"]
    page.note(f"{pd['transfers']} KV transfers, {pd['transfer_bytes'] / 1e9:.2f} GB ({pd['intra_node_transfers']} inside a node); "
              f"delay after the prefill p50 {delay['p50'] or 0:.4f} s, p99 {delay['p99'] or 0:.4f} s, "
              f"of which the connector left exposed p50 {exposed['p50'] or 0:.4f} s.")
    moved = ~np.isnan(requests["kv_transfer_s"])
    fig = go.Figure()
    for decode in np.unique(requests["decode_instance"][moved]).tolist():
        rows = moved & (requests["decode_instance"] == decode)
        fig.add_trace(go.Scattergl(x=requests["arrival_s"][rows], y=requests["kv_transfer_s"][rows], mode="markers",
                                   name=f"to decode instance {int(decode)}", marker={"size": 4}))
    page.figure(styled(fig, "KV transfers: the wait from the prefill's end to the KV's arrival",
                       xaxis_title="request arrival (s)", yaxis_title="seconds"))


def _tier_traffic(page: Page, tiered: list[tuple[str, dict]]) -> None:
    """Where each instance's prompt tokens came from, and the bytes its tiers moved."""
    names = [name for name, _ in tiered]
    sources = max((list(t["tokens"]) for _, t in tiered), key=len)  # hbm, host, ssd, (store,) recomputed
    fig = go.Figure([go.Bar(x=names, y=[t["tokens"].get(source, 0) for _, t in tiered], name=source) for source in sources])
    fig.update_layout(barmode="stack")
    page.figure(styled(fig, "Prompt tokens by where their KV came from (first admissions)", yaxis_title="tokens"))
    directions = max((list(t["bytes"]) for _, t in tiered), key=len)
    page.table(["instance", *(f"{d.replace('_to_', ' -> ')} (GB)" for d in directions), "transfer exposed (s)"],
               [[name, *(f"{t['bytes'].get(d, 0) / 1e9:.3f}" for d in directions), f"{t['transfer_exposed_s']:.3f}"]
                for name, t in tiered])
