"""Policies side by side: any set of ``kvsim simulate``/``execute`` runs in one HTML page and one JSON.

A sweep directory (``kvsim sweep``'s ``--out``) stands for all its points that ran.

Goodput counts the requests that met both latency objectives (every sequence of a request
finished, its TTFT within the TTFT objective and each sequence's TPOT within the TPOT
objective) per second of the run's makespan.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvsim.reports.figures import cdf_figure, latency_cdfs, palette, series_data, styled
from kvsim.reports.page import Cell, Page
from kvsim.reports.runs import ReportInputError, Run, default_labels, load_run
from kvsim.sim.studies.sweep import SWEEP_CSV, point_dir_name

WASTE_NOTE = (
    "steps.csv records KV blocks (in use, cached, free) but not the tokens they hold, so internal waste "
    "(allocated token slots holding no token) cannot be drawn from the run files. KV blocks held per "
    "scheduled sequence (blocks in use / batch size) is the nearest figure they support: a max-length "
    "reservation shows up as many blocks per sequence, prefix sharing as fewer."
)


@dataclass(frozen=True)
class Slo:
    """Latency objectives a request must meet to count towards goodput."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1


def write_compare_report(
    run_dirs: list[Path], out_dir: Path, labels: list[str] | None = None, slo: Slo = Slo()
) -> tuple[Path, Path]:
    """Write ``out_dir/compare.html`` and ``out_dir/compare.json``; returns both paths."""
    run_dirs = expand_run_dirs(run_dirs)
    if not run_dirs:
        raise ReportInputError("compare needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    if labels is None:
        labels = default_labels(runs)
    if len(labels) != len(runs):
        raise ReportInputError(f"{len(labels)} label(s) for {len(runs)} run(s)")
    if len(set(labels)) != len(labels):
        raise ReportInputError(f"labels must be distinct: {', '.join(labels)}")
    data = compare_data(dict(zip(labels, runs)), slo)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "compare.json"
    json_path.write_text(json.dumps(_json_safe(data), indent=1) + "\n")
    html_path = compare_page(data).write(out_dir / "compare.html")
    return html_path, json_path


def expand_run_dirs(paths: list[Path]) -> list[Path]:
    """Run directories, a sweep directory replaced by its points that ran (in sweep.csv order)."""
    out: list[Path] = []
    for path in map(Path, paths):
        sweep_csv = path / SWEEP_CSV
        if not sweep_csv.is_file():
            out.append(path)
            continue
        with sweep_csv.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        if not rows or "name" not in rows[0]:
            raise ReportInputError(f"{sweep_csv}: not a kvsim sweep table (no name column)")
        out += [path / point_dir_name(r["name"]) for r in rows if r.get("status", "ok") == "ok"]
    return out


def seconds(value: float) -> str:
    """A latency in the unit that reads best: ms below a second, s above."""
    if value < 1:
        return f"{1e3 * value:.1f} ms"
    return f"{value:.2f} s" if value < 100 else f"{value:,.0f} s"


def compare_data(runs: dict[str, Run], slo: Slo) -> dict:
    """Every number the comparison page draws: per-run rows and each figure's series."""
    rows = {label: run_row(label, run, slo) for label, run in runs.items()}
    kv_usage, per_sequence = {}, {}
    for label, run in runs.items():
        steps = run.steps
        kv_usage[label] = series_data(
            steps["start_s"], {"used_pct": 100 * steps["kv_used"] / run.num_blocks, "cached_pct": 100 * steps["kv_cached"] / run.num_blocks}
        )
        busy = steps["batch_size"] > 0
        per_sequence[label] = series_data(steps["start_s"][busy], {"blocks": steps["kv_used"][busy] / steps["batch_size"][busy]})
    return {
        "slo": asdict(slo),
        "notes": [WASTE_NOTE],
        "runs": list(rows.values()),
        "figures": {
            "throughput_vs_p99_ttft": {
                label: {"p99_ttft_s": r["ttft_p99_s"], "throughput_tok_s": r["throughput_tok_s"]} for label, r in rows.items()
            },
            "goodput": {
                label: {k: r[k] for k in ("requests", "meeting_slo", "goodput_rps", "request_rate_rps")}
                for label, r in rows.items()
            },
            "kv_usage_pct": kv_usage,
            "kv_blocks_per_sequence": per_sequence,
            "prefix_hit_rate": {label: r["prefix_hit_rate"] for label, r in rows.items()},
            "preemptions": {label: r["preemptions"] for label, r in rows.items()},
            "rejections": {label: r["rejection_reasons"] for label, r in rows.items()},
            "latency_cdfs": latency_cdfs(runs),
        },
    }


def run_row(label: str, run: Run, slo: Slo) -> dict:
    s = run.summary
    met, total = slo_attainment(run, slo)
    duration = s["duration_s"]
    return {
        "label": label,
        "run_dir": str(run.path),
        "scheduler": run.config.get("scheduler"),
        "block_manager": run.config.get("block_manager"),
        "requests": total,
        "completed": s["requests_completed"],
        "rejected": s["requests_rejected"],
        "duration_s": duration,
        "throughput_tok_s": s["throughput_tok_s"],
        "request_rate_rps": s["request_rate_rps"],
        "meeting_slo": met,
        "goodput_rps": met / duration if duration > 0 else 0.0,
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tpot_p50_s": s["tpot_s"]["p50"],
        "tpot_p99_s": s["tpot_s"]["p99"],
        "e2e_p99_s": s["e2e_s"]["p99"],
        "preemptions": s["preemptions"],
        "prefix_hit_rate": s["prefix_hit_rate"],
        "peak_kv_blocks_used": s["peak_kv_blocks_used"],
        "num_kv_blocks": s["num_kv_blocks"],
        "mean_kv_usage": s["mean_kv_usage"],
        "rejection_reasons": s.get("rejection_reasons", {}),
    }


def slo_attainment(run: Run, slo: Slo) -> tuple[int, int]:
    """(requests meeting both objectives, requests) from requests.csv; samples count with their parent."""
    req = run.requests
    ok: dict[str, bool] = {}
    for rid, parent, status, ttft, tpot in zip(req["request_id"], req["parent"], req["status"], req["ttft_s"], req["tpot_s"]):
        root = parent or rid
        good = status == "finished" and (math.isnan(tpot) or tpot <= slo.tpot_s)
        if not parent:
            good = good and ttft <= slo.ttft_s
        ok[root] = ok.get(root, True) and bool(good)
    return sum(ok.values()), len(ok)


def compare_page(data: dict) -> Page:
    figures = data["figures"]
    labels = list(figures["goodput"])
    colors = palette(labels)
    slo = data["slo"]
    page = Page("kvsim policy comparison")
    page.note(f"{len(labels)} runs: " + "; ".join(f"{r['label']} ({r['run_dir']})" for r in data["runs"]))
    page.heading("Throughput and latency")
    page.figure(_throughput_vs_ttft(figures["throughput_vs_p99_ttft"], colors))
    page.figure(_goodput(figures["goodput"], slo, colors))
    page.figure(cdf_figure(figures["latency_cdfs"], "Latency CDFs, per request", colors))
    page.heading("KV cache")
    page.figure(_kv_timelines(figures["kv_usage_pct"], figures["kv_blocks_per_sequence"], colors))
    page.note(WASTE_NOTE)
    page.figure(_counters(figures, colors))
    page.heading("All figures")
    _table(page, data)
    return page


def _throughput_vs_ttft(points: dict, colors: dict[str, str]) -> go.Figure:
    fig = go.Figure()
    positions = ("top center", "bottom center", "middle right", "middle left")  # nearby points' labels overlap less
    for i, (label, p) in enumerate(points.items()):
        fig.add_trace(
            go.Scatter(
                x=[p["p99_ttft_s"]], y=[p["throughput_tok_s"]], mode="markers+text", name=label, text=[label],
                textposition=positions[i % len(positions)], marker={"size": 14, "color": colors[label]},
                hovertemplate=f"{label}<br>p99 TTFT %{{x:.4g}} s<br>%{{y:.4g}} tok/s<extra></extra>",
            )
        )
    fig.update_xaxes(type="log")  # p99 TTFT spans milliseconds to minutes between a healthy and an overloaded run
    return styled(fig, "Output throughput vs p99 TTFT (one point per run; up and left is better)",
                  xaxis_title="p99 TTFT (s, log scale)", yaxis_title="output throughput (tok/s)")


def _goodput(goodput: dict, slo: dict, colors: dict[str, str]) -> go.Figure:
    labels = list(goodput)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[g["request_rate_rps"] for g in goodput.values()], name="completed requests/s",
                         marker={"color": "#c7c7c7"}))
    fig.add_trace(
        go.Bar(
            x=labels, y=[g["goodput_rps"] for g in goodput.values()], name="goodput: requests/s meeting both SLOs",
            marker={"color": [colors[label] for label in labels]},
            text=[f"{g['meeting_slo']}/{g['requests']}" for g in goodput.values()], textposition="outside",
        )
    )
    fig.update_layout(barmode="group")
    fig.update_xaxes(tickangle=-30, automargin=True)  # long labels (sweep points) slant instead of overlapping
    title = f"Goodput under SLOs (TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s']:g} s); labels: requests meeting / all"
    return styled(fig, title, xaxis_title="run", yaxis_title="requests per second")


def _kv_timelines(usage: dict, per_sequence: dict, colors: dict[str, str]) -> go.Figure:
    """One row per run (overlaid, bursty runs hide each other): pool usage left, blocks per sequence right."""
    labels = list(usage)
    fig = make_subplots(rows=len(labels), cols=2, shared_xaxes=True, vertical_spacing=min(0.08, 0.3 / len(labels)),
                        column_titles=["KV pool usage (% of blocks)", "KV blocks held per scheduled sequence"],
                        row_titles=labels)
    for row, label in enumerate(labels, start=1):
        u, s = usage[label], per_sequence[label]
        line = {"color": colors[label], "shape": "hv"}
        fig.add_trace(go.Scatter(x=np.asarray(u["t_used_pct"]), y=np.asarray(u["used_pct"]), mode="lines",
                                 name=f"{label}: in use", line=line), row, 1)
        if any(v > 0 for v in u["cached_pct"]):
            fig.add_trace(go.Scatter(x=np.asarray(u["t_cached_pct"]), y=np.asarray(u["cached_pct"]), mode="lines",
                                     name=f"{label}: cached, unreferenced", line={**line, "dash": "dot"}, opacity=0.6), row, 1)
        fig.add_trace(go.Scatter(x=np.asarray(s["t_blocks"]), y=np.asarray(s["blocks"]), mode="lines",
                                 name=f"{label}: blocks per sequence", line=line), row, 2)
        fig.update_yaxes(title_text="%", rangemode="tozero", row=row, col=1)
        fig.update_yaxes(title_text="blocks", rangemode="tozero", row=row, col=2)
    fig.update_xaxes(title_text="time (s)", row=len(labels))
    fig.update_annotations(font_size=13)
    fig.update_layout(showlegend=False)
    return styled(fig, "KV cache over time, one row per run (solid: blocks in use; dotted: cached blocks no request holds)",
                  height=120 + 200 * len(labels))


def _counters(figures: dict, colors: dict[str, str]) -> go.Figure:
    labels = list(figures["preemptions"])
    fig = make_subplots(rows=1, cols=3, subplot_titles=["Prefix cache hit rate", "Preemptions", "Rejected requests by reason"])
    bar_colors = {"color": [colors[label] for label in labels]}
    hit_pct = [100 * figures["prefix_hit_rate"][label] for label in labels]
    fig.add_trace(go.Bar(x=labels, y=hit_pct, marker=bar_colors, showlegend=False), 1, 1)
    fig.add_trace(go.Bar(x=labels, y=[figures["preemptions"][label] for label in labels], marker=bar_colors, showlegend=False), 1, 2)
    reasons = sorted({r for counts in figures["rejections"].values() for r in counts})
    for reason in reasons:
        rejected = [figures["rejections"][label].get(reason, 0) for label in labels]
        fig.add_trace(go.Bar(x=labels, y=rejected, name=f"rejected: {reason}"), 1, 3)
    if not reasons:
        fig.add_annotation(text="no rejections", xref="x3 domain", yref="y3 domain", x=0.5, y=0.5, showarrow=False)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(tickangle=-30, automargin=True)
    fig.update_yaxes(title_text="prompt tokens served from cache (%)", row=1, col=1)
    fig.update_yaxes(title_text="preemptions", row=1, col=2)
    fig.update_yaxes(title_text="requests", row=1, col=3)
    fig.update_yaxes(rangemode="tozero")
    return styled(fig, "Prefix hits, preemptions and rejections", height=460)


TABLE_COLUMNS = (
    ("label", "run", str),
    ("scheduler", "scheduler", str),
    ("block_manager", "block manager", str),
    ("completed", "completed", "{:,}".format),
    ("rejected", "rejected", "{:,}".format),
    ("throughput_tok_s", "tok/s", "{:.1f}".format),
    ("request_rate_rps", "req/s", "{:.3f}".format),
    ("goodput_rps", "goodput req/s", "{:.3f}".format),
    ("ttft_p50_s", "TTFT p50", seconds),
    ("ttft_p99_s", "TTFT p99", seconds),
    ("tpot_p50_s", "TPOT p50", seconds),
    ("tpot_p99_s", "TPOT p99", seconds),
    ("preemptions", "preemptions", "{:,}".format),
    ("prefix_hit_rate", "prefix hit", lambda v: f"{100 * v:.1f}%"),
    ("peak_kv_blocks_used", "peak KV blocks", "{:,}".format),
    ("num_kv_blocks", "KV blocks", "{:,}".format),
    ("mean_kv_usage", "mean KV usage", lambda v: f"{100 * v:.1f}%"),
)


def _table(page: Page, data: dict) -> None:
    rows = [
        [Cell("n/a") if r[key] is None else Cell(fmt(r[key]), "text" if fmt is str else "") for key, _, fmt in TABLE_COLUMNS]
        for r in data["runs"]
    ]
    page.table([heading for _, heading, _ in TABLE_COLUMNS], rows)


def _json_safe(value):
    """NaN and numpy scalars become JSON-friendly."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
