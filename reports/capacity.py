"""The page of ``kvsim capacity``: capacity and goodput per configuration, and every probe."""

from __future__ import annotations

import plotly.graph_objects as go

from kvsim.reports.figures import palette, styled
from kvsim.reports.page import Page


def capacity_page(data: dict) -> Page:
    configs = data["configs"]
    labels = [c["name"] or "config" for c in configs]
    colors = palette(labels)
    page = Page("kvsim capacity")
    page.note(f"Highest request rate meeting {data['slo']['description']}, per configuration (bisection on the "
              "trace's arrival process scaled in rate).")
    page.figure(_capacity_bars(configs, labels, colors))
    page.figure(_probes(configs, labels, colors))
    page.table(["configuration", "capacity (req/s)", "missed at (req/s)", "goodput (req/s)", "trace rate (req/s)", "probes", "error"],
               [[label, f"{c['capacity_rps']:.3f}", _num(c["bracket"][1]), _num(_goodput(c)), f"{c['trace_rate_rps']:.3f}",
                 str(len(c["probes"])), c["error"]] for label, c in zip(labels, configs)])
    return page


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _goodput(config: dict) -> float | None:
    best = [p for p in config["probes"] if p["met"] and p["rate"] == config["capacity_rps"]]
    return best[0]["goodput_rps"] if best else None


def _capacity_bars(configs: list[dict], labels: list[str], colors: dict[str, str]) -> go.Figure:
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[c["capacity_rps"] for c in configs], name="capacity (req/s)",
                         marker={"color": [colors[label] for label in labels]},
                         text=[f"{c['capacity_rps']:.2f}" for c in configs], textposition="outside"))
    fig.add_trace(go.Bar(x=labels, y=[_goodput(c) or 0.0 for c in configs], name="goodput at capacity (req/s)",
                         marker={"color": "#c7c7c7"}))
    fig.update_layout(barmode="group")
    fig.update_xaxes(tickangle=-30, automargin=True)
    return styled(fig, "Capacity and goodput per configuration", xaxis_title="configuration", yaxis_title="requests per second")


def _probes(configs: list[dict], labels: list[str], colors: dict[str, str]) -> go.Figure:
    fig = go.Figure()
    for label, c in zip(labels, configs):
        for met, symbol in ((True, "circle"), (False, "x")):
            rates = [p["rate"] for p in c["probes"] if p["met"] is met]
            fig.add_trace(go.Scatter(x=rates, y=[label] * len(rates), mode="markers", name=f"{label}: {'met' if met else 'missed'}",
                                     marker={"symbol": symbol, "size": 10, "color": colors[label]}, showlegend=False))
    fig.update_xaxes(type="log")
    fig.update_yaxes(automargin=True)
    return styled(fig, "Every probe (circle: met the SLOs, cross: missed)", height=160 + 40 * len(labels),
                  xaxis_title="request rate (req/s, log scale)")
