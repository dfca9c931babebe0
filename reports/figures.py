"""Figure data shared by the reports, and the plotly figures drawn from it.

Each figure is built from a plain dict of lists (its "data"), so the numbers a report
draws are the very numbers it writes to JSON for scripts. Series go to plotly as numpy
arrays, which it embeds as base64 typed arrays: about half the bytes of decimal text.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvsim.reports.downsample import MAX_POINTS, even_indices, minmax_indices
from kvsim.reports.runs import Run

LATENCIES = {"ttft_s": "TTFT", "tpot_s": "TPOT", "e2e_s": "End-to-end latency"}
KIND_COLORS = {"prefill": "#1f77b4", "decode": "#ff7f0e", "mixed": "#2ca02c", "idle": "#7f7f7f"}


def styled(fig: go.Figure, title: str, height: int = 450, **axes: str) -> go.Figure:
    """White template, a title and axis titles (``xaxis_title=...``); legends stay readable."""
    fig.update_layout(
        template="plotly_white",
        title={"text": title, "x": 0.01},
        height=height,
        margin={"l": 70, "r": 30, "t": 70, "b": 60},
        legend={"font": {"size": 12}},
        **axes,
    )
    return fig


def latency_samples(run: Run, metric: str) -> np.ndarray:
    """Per-request latencies as the summary counts them.

    TTFT and end-to-end latency are per request (a parallel-sampling request ends when its
    last sample does); TPOT is per finished sequence, samples included.
    """
    req = run.requests
    roots = req["parent"] == ""
    if metric == "tpot_s":
        values = req["tpot_s"][req["status"] == "finished"]
    elif metric == "ttft_s":
        values = req["ttft_s"][roots]
    elif metric == "e2e_s":
        values = family_e2e(run)
    else:
        raise ValueError(f"unknown latency metric {metric!r}")
    return values[np.isfinite(values)]


def family_e2e(run: Run) -> np.ndarray:
    """End-to-end latency of every request whose sequences all finished (NaN-free)."""
    req = run.requests
    finish: dict[str, float] = {}  # request -> its last sequence's finish, NaN while any is unfinished
    for rid, parent, status, fin in zip(req["request_id"], req["parent"], req["status"], req["finish_s"]):
        root = parent or rid
        finish[root] = np.maximum(finish.get(root, -np.inf), fin if status == "finished" else np.nan)
    roots = req["parent"] == ""
    arrival = dict(zip(req["request_id"][roots], req["arrival_s"][roots]))
    values = np.array([finish[r] - arrival[r] for r in arrival], dtype=np.float64)
    return values[np.isfinite(values)]


def cdf_data(values: np.ndarray, max_points: int = MAX_POINTS) -> dict[str, list[float]]:
    """An empirical CDF (x sorted, p = fraction <= x), thinned to evenly spaced ranks."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    p = np.arange(1, len(x) + 1) / max(len(x), 1)
    keep = even_indices(len(x), max_points)
    return {"x": x[keep].tolist(), "p": p[keep].tolist()}


def latency_cdfs(runs: dict[str, Run]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """``{metric: {run name: cdf}}`` for TTFT, TPOT and end-to-end latency."""
    return {m: {name: cdf_data(latency_samples(run, m)) for name, run in runs.items()} for m in LATENCIES}


def cdf_figure(data: dict[str, dict[str, dict[str, list[float]]]], title: str, colors: dict[str, str]) -> go.Figure:
    metrics = list(data)
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[LATENCIES[m] for m in metrics])
    for col, metric in enumerate(metrics, start=1):
        for name, cdf in data[metric].items():
            fig.add_trace(
                go.Scatter(
                    x=np.asarray(cdf["x"]), y=np.asarray(cdf["p"]), mode="lines", name=name, legendgroup=name, showlegend=col == 1,
                    line={"color": colors[name], "shape": "hv"},
                ),
                row=1, col=col,
            )
        fig.update_xaxes(title_text=f"{LATENCIES[metric]} (s)", type="log", row=1, col=col)
        fig.update_yaxes(title_text="fraction of requests" if col == 1 else None, range=[0, 1.02], row=1, col=col)
    return styled(fig, title, height=420)


def series_data(t: np.ndarray, columns: dict[str, np.ndarray], max_points: int = MAX_POINTS) -> dict[str, list]:
    """Time series thinned per column (each keeps its own minima and maxima), ``t_<name>`` beside each."""
    out: dict[str, list] = {}
    for name, y in columns.items():
        keep = minmax_indices(y, max_points)
        out[f"t_{name}"] = t[keep].tolist()
        out[name] = y[keep].tolist()
    return out


def palette(names: list[str]) -> dict[str, str]:
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
    return {name: colors[i % len(colors)] for i, name in enumerate(names)}
