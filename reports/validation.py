"""The cross-validation report: is the simulator's world the real one?

Drawn from ``kvsim validate``'s ``validation.json`` and the run directories it compared:
``real`` (measured on a device), ``sim`` (a free-running simulation of the same trace) and,
when it is a full run directory, ``replay`` (the simulator fed the measured step times, whose
decision log must equal the real one).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import plotly.graph_objects as go

from kvsim.realexec.validation import reference_ratios
from kvsim.reports.downsample import MAX_POINTS, minmax_indices
from kvsim.reports.figures import KIND_COLORS, LATENCIES, cdf_figure, latency_cdfs, series_data, styled
from kvsim.reports.page import Cell, Page
from kvsim.reports.runs import ReportInputError, Run, is_run_dir, load_run

RUN_NAMES = ("real", "sim", "replay")
RUN_COLORS = {"real": "#222222", "sim": "#1f77b4", "replay": "#ff7f0e"}
CHECK_GROUPS = ("decisions", "timing", "latency", "memory")
REQUIRED = ("passed", "checks", "decision_identity", "timing", "memory")
BATCH_SHAPE = ("kind", "batch_size", "prefill_tokens", "decode_tokens")
PLAN_FIELDS = ("entries", "preempted", "rejected", "copies", "swap_out", "swap_in", "forks", "block_tables", "slot_mapping")
HIST_BINS = 50


def write_validation_report(validation: dict, run_dirs: dict[str, Path], out_path: Path) -> Path:
    """Write the validation report for ``validation`` (validation.json's dict) to ``out_path``.

    ``run_dirs`` maps "real" and "sim" (and optionally "replay") to run directories.
    """
    missing = missing_keys(validation)
    if missing:
        raise ReportInputError(f"not a kvsim validation result (missing {', '.join(missing)})")
    for name in ("real", "sim"):
        if name not in run_dirs:
            raise ReportInputError(f"validation report needs a {name!r} run directory")
    # replay/ may hold only its decision log; it is drawn when it is a whole run
    names = [n for n in RUN_NAMES if n in ("real", "sim") or (n in run_dirs and is_run_dir(run_dirs[n]))]
    runs = {name: load_run(run_dirs[name]) for name in names}
    return validation_page(validation, runs).write(out_path)


def missing_keys(validation: object) -> list[str]:
    """The required top-level keys ``validation`` lacks (all of them when it is not a dict)."""
    if not isinstance(validation, dict):
        return list(REQUIRED)
    return [k for k in REQUIRED if k not in validation]


def validation_page(validation: dict, runs: dict[str, Run]) -> Page:
    page = Page("kvsim validation report")
    verdict = validation.get("verdict")  # older validation.json files have none
    if verdict is None:
        page.banner("PASSED" if validation["passed"] else "FAILED", bool(validation["passed"]))
    else:
        page.banner(verdict["outcome"].upper(), {"pass": True, "fail": False}.get(verdict["outcome"]))
        page.note(verdict["line"])
    page.note(_provenance(validation, runs))
    if validation.get("clocks"):
        page.note("Clocks: " + "; ".join(f"{figure.replace('_', ' ')} on {clock}" for figure, clock in validation["clocks"].items()))
    _checks_section(page, validation["checks"], validation.get("repeatability", {}).get("spread", {}))
    identity = validation["decision_identity"]
    _decisions_section(page, identity)
    _timing_section(page, validation["timing"], *step_times(validation, runs["real"], runs["sim"]))
    _latency_section(page, validation["timing"], runs)
    _memory_section(page, validation["memory"], runs)
    return page


def _provenance(validation: dict, runs: dict[str, Run]) -> str:
    config = validation.get("config") or runs["sim"].config
    fields = [f"backend {validation.get('backend', '?')}", f"profile {validation.get('profile') or 'none'}"]
    fields += [f"{k} {config[k]}" for k in ("trace", "model", "device", "scheduler", "block_manager", "block_size") if k in config]
    fields += [f"{name} run: {run.path}" for name, run in runs.items()]
    return "; ".join(fields)


# --- checks and decisions ---------------------------------------------------------------


def _checks_section(page: Page, checks: list[dict], spread: dict[str, float | None]) -> None:
    """Each check's figure and limit, beside the real-vs-real spread its verdict weighs a miss against (timing checks)."""
    page.heading("Checks")
    order = {g: i for i, g in enumerate(CHECK_GROUPS)}
    rows = [
        [
            Cell(c["name"], "text"),
            Cell(c.get("group", ""), "text"),
            _num(c.get("value")),
            _num(c.get("threshold")),
            Cell("pass" if c["passed"] else "FAIL", "pass" if c["passed"] else "fail"),
            _num(spread.get(c["name"])),
        ]
        for c in sorted(checks, key=lambda c: order.get(c.get("group"), len(order)))
    ]
    page.table(["check", "group", "value", "threshold", "result", "real-vs-real spread"], rows)


def _decisions_section(page: Page, identity: dict) -> None:
    page.heading("Decisions")
    steps = identity.get("steps_compared", 0)
    if identity["identical"]:
        page.banner(f"identical decision logs over {steps} steps", True)
        return
    first = identity.get("first_divergence")
    if first is None:
        page.banner(f"decision logs differ ({steps} steps compared)", False)
        return
    page.banner(f"first divergence at step {first['step']} (of {steps} compared)", False)
    real, sim = first.get("real"), first.get("sim")
    rows = []
    for name in PLAN_FIELDS:
        a, b = _plan_field(real, name), _plan_field(sim, name)
        css = "text diff" if a != b else "text"
        rows.append([Cell(name, "text"), Cell(a, css, preformatted=True), Cell(b, css, preformatted=True)])
    page.table(["plan field", "real", "sim"], rows)
    page.note("Highlighted rows differ; a side with no plan had ended. The simulator side is the replay of the "
              "measured step times, so a difference is a decision mismatch, not a timing one.")


def _plan_field(plan: dict | None, name: str, limit: int = 40) -> str:
    if plan is None:
        return "(no step: the run had ended)"
    value = plan.get(name, [])
    if name == "entries":
        lines = [
            f"{rid}: {'prefill' if kind == 'p' else 'decode'} [{first}, {first + num})" + (", samples a token" if samples else "")
            for rid, first, num, kind, samples in value
        ]
    elif name == "block_tables":
        lines = [f"{rid}: {json.dumps(table)}" for rid, table in value.items()]
    elif name == "slot_mapping":
        text = json.dumps(value[:32])
        return f"{len(value)} slots: {text[:-1]}, ...]" if len(value) > 32 else f"{len(value)} slots: {text}"
    else:
        lines = [json.dumps(v) for v in value]
    if not lines:
        return "-"
    more = f"\n... {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


# --- per-step timing --------------------------------------------------------------------


def step_times(validation: dict, real: Run, sim: Run) -> tuple[dict[str, np.ndarray], str]:
    """Measured and predicted duration per step, the step's kind and whether both did the same work.

    ``kvsim validate`` stores the cost model's prediction for every plan the device ran
    (``series.step_time``): the very same plans, so every pair is matched. Without it, the
    free simulation's steps are paired with the real ones by step number and a pair counts
    as matched only when both steps had the same batch (kind, size, prefill and decode tokens).
    Also returns a sentence saying which it was.
    """
    series = (validation.get("series") or {}).get("step_time")
    if series:
        measured = np.asarray(series["measured"], dtype=np.float64)
        timed_steps = real.steps["step"][real.steps["timed"] == 1].astype(np.int64)
        return {
            "step": timed_steps if len(timed_steps) == len(measured) else np.arange(len(measured)),
            "measured_s": measured,
            "predicted_s": np.asarray(series["predicted"], dtype=np.float64),
            "kind": np.asarray(series["kind"], dtype=str),
            "matched": np.ones(len(measured), dtype=bool),
        }, f"{len(measured)} steps the device ran, each predicted by the cost model for the same plan."
    pairs = step_pairs(real, sim)
    return pairs, (
        f"{len(pairs['step'])} steps in both runs, paired by step number; {int(pairs['matched'].sum())} had the same batch "
        "in both. The others are greyed (click the legend to show them) and left out of the histogram."
    )


def step_pairs(real: Run, sim: Run) -> dict[str, np.ndarray]:
    """Timed steps present in both runs, paired by step number; ``matched`` where the batches agree."""
    r_idx = np.flatnonzero(real.steps["timed"] == 1)
    s_idx = np.flatnonzero(sim.steps["timed"] == 1)
    common, ri, si = np.intersect1d(real.steps["step"][r_idx].astype(np.int64), sim.steps["step"][s_idx].astype(np.int64),
                                    return_indices=True)
    ri, si = r_idx[ri], s_idx[si]
    matched = np.ones(len(common), dtype=bool)
    for name in BATCH_SHAPE:
        matched &= real.steps[name][ri] == sim.steps[name][si]
    return {
        "step": common,
        "measured_s": real.steps["duration_s"][ri],
        "predicted_s": sim.steps["duration_s"][si],
        "kind": real.steps["kind"][ri],
        "matched": matched,
    }


def _timing_section(page: Page, timing: dict, pairs: dict[str, np.ndarray], source: str) -> None:
    page.heading("Step time: predicted vs measured")
    page.note(source)
    page.figure(step_scatter(pairs))
    page.figure(error_histogram(pairs))
    per_step = timing.get("per_step", {})
    groups = [("all steps", per_step), *per_step.get("by_kind", {}).items(),
              *((f"decode, {n} in the batch", stats) for n, stats in per_step.get("decode_by_batch_size", {}).items())]
    rows = [[name, _pct(stats.get("mape")), _ratio(stats.get("median_ratio")), _ms(stats.get("p90_abs_error_s")),
             str(stats.get("steps", "n/a"))] for name, stats in groups]
    page.table(["steps", "MAPE", "median measured / predicted", "p90 |error| (ms)", "count"], rows)
    if per_step.get("noise_floor") is not None:
        page.note(f"Timing noise of single steps while the profile was measured (mean |run / median - 1|): "
                  f"{100 * per_step['noise_floor']:.1f} %. No model predicts single steps much better than that on this machine.")
    speed = timing.get("speed_check")
    if speed:
        if speed.get("profiled_s"):
            page.note(f"Speed check after the real run: reference steps took {reference_ratios(speed, 'profiled_s')} of their times "
                      f"when the machine was profiled (far from 1: the machine's speed changed since), and {reference_ratios(speed)} "
                      f"of the profile's prediction ({speed['ratio']:.2f}x their median: the machine's change and the "
                      "model's error together).")
        else:
            page.note(f"Speed check after the real run: reference steps ({reference_ratios(speed)}) took {speed['ratio']:.2f}x the "
                      "profile's prediction (their median); far from 1, the machine's speed changed since it was profiled "
                      "or the model misses these steps (this profile did not record their times when it was measured).")


def step_scatter(pairs: dict[str, np.ndarray]) -> go.Figure:
    fig = go.Figure()
    measured, predicted = pairs["measured_s"], pairs["predicted_s"]
    positive = (measured > 0) & (predicted > 0)
    groups = [(k, pairs["matched"] & (pairs["kind"] == k), KIND_COLORS[k], True) for k in KIND_COLORS]
    groups.append(("different batch", ~pairs["matched"], "#c7c7c7", "legendonly"))
    for name, mask, color, visible in groups:
        mask = mask & positive
        if not mask.any():
            continue
        error = (predicted[mask] - measured[mask]) / measured[mask]
        keep = minmax_indices(error)  # the worst over- and under-predictions always stay
        fig.add_trace(
            go.Scatter(
                x=measured[mask][keep], y=predicted[mask][keep], mode="markers", name=f"{name} ({mask.sum()} steps)",
                customdata=pairs["step"][mask][keep], visible=visible,
                marker={"color": color, "size": 5, "opacity": 0.7},
                hovertemplate="step %{customdata}<br>measured %{x:.4g} s<br>predicted %{y:.4g} s<extra></extra>",
            )
        )
    if positive.any():
        lo = float(min(measured[positive].min(), predicted[positive].min()))
        hi = float(max(measured[positive].max(), predicted[positive].max()))
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x", line={"color": "black", "dash": "dash"}))
    thinned = f" (at most {MAX_POINTS} points per kind; extremes kept)" if len(measured) > MAX_POINTS else ""
    fig = styled(fig, "Per-step duration, predicted (sim) vs measured (real)" + thinned, height=640,
                 xaxis_title="measured step time (s)", yaxis_title="predicted step time (s)")
    fig.update_layout(width=900)  # near-square, so y = x runs at 45 degrees
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log", scaleanchor="x", scaleratio=1)
    return fig


def error_histogram(pairs: dict[str, np.ndarray]) -> go.Figure:
    fig = go.Figure()
    mask = pairs["matched"] & (pairs["measured_s"] > 0)
    error = 100 * (pairs["predicted_s"][mask] - pairs["measured_s"][mask]) / pairs["measured_s"][mask]
    kinds = pairs["kind"][mask]
    title = "Per-step relative error of the prediction"
    if len(error):
        lo, hi = np.percentile(error, [0.5, 99.5])
        if hi <= lo:
            lo, hi = lo - 1.0, hi + 1.0
        edges = np.linspace(lo, hi, HIST_BINS + 1)
        clipped = np.clip(error, lo, hi)
        centers = (edges[:-1] + edges[1:]) / 2
        for kind in KIND_COLORS:
            counts, _ = np.histogram(clipped[kinds == kind], bins=edges)
            if counts.any():
                fig.add_trace(go.Bar(x=centers, y=counts, width=edges[1] - edges[0], name=kind,
                                     marker={"color": KIND_COLORS[kind]}))
        fig.add_vline(x=0, line={"color": "black", "dash": "dash"})
        title += f" ({len(error)} steps; the 1% in the tails are counted in the end bins)"
    fig.update_layout(barmode="stack", bargap=0)
    return styled(fig, title, height=420, xaxis_title="(predicted - measured) / measured (%)", yaxis_title="steps")


# --- latency and memory -----------------------------------------------------------------


def _latency_section(page: Page, timing: dict, runs: dict[str, Run]) -> None:
    page.heading("Latency")
    page.figure(cdf_figure(latency_cdfs(runs), "Latency CDFs, per request", RUN_COLORS))
    rows = []
    for metric, label in LATENCIES.items():
        for pct, values in timing.get("latency", {}).get(metric, {}).items():
            rows.append([f"{label} {pct} (ms)", _ms(values.get("real")), _ms(values.get("sim")), _pct(values.get("rel_error"))])
    for key, label, fmt in (("throughput_tok_s", "output throughput (tok/s)", _num), ("makespan_s", "makespan (s)", _num)):
        if key in timing:
            t = timing[key]
            rows.append([label, fmt(t.get("real")), fmt(t.get("sim")), _pct(t.get("rel_error"))])
    page.table(["metric", "real", "sim", "relative error"], rows)


def _memory_section(page: Page, memory: dict, runs: dict[str, Run]) -> None:
    page.heading("KV cache and memory")
    fig = go.Figure()
    for name, run in runs.items():
        steps = run.steps
        data = series_data(steps["start_s"], {"kv_used": steps["kv_used"]})
        fig.add_trace(go.Scatter(x=np.asarray(data["t_kv_used"]), y=np.asarray(data["kv_used"]), mode="lines",
                                 name=f"{name} ({run.num_blocks} blocks)", line={"color": RUN_COLORS[name], "shape": "hv"}))
    page.figure(styled(fig, "KV blocks in use over time", height=420, xaxis_title="time (s)",
                       yaxis_title="KV blocks in use"))
    rows = []
    for key, label in (("kv_pool_bytes", "KV pool"), ("peak_device_bytes", "peak device memory")):
        if key in memory:
            m = memory[key]
            rows.append([label, _bytes(m.get("predicted")), _bytes(m.get("measured")), _pct(m.get("rel_error"))])
    page.table(["memory", "predicted", "measured", "relative error"], rows)
    rows = []
    for key, label in (("peak_kv_blocks_used", "peak KV blocks in use"), ("preemptions", "preemptions")):
        if key in memory:
            rows.append([label, _num(memory[key].get("real")), _num(memory[key].get("sim"))])
    page.table(["count", "real", "sim"], rows)


def _num(value) -> Cell:
    if value is None:
        return Cell("n/a")
    if isinstance(value, (int, np.integer)) or float(value).is_integer():
        return Cell(f"{int(value):,}")
    return Cell(f"{value:.4g}")


def _pct(value) -> Cell:
    return Cell("n/a" if value is None else f"{100 * value:.2f}%")


def _ms(value) -> Cell:
    return Cell("n/a" if value is None else f"{1e3 * value:.3f}")


def _ratio(value) -> Cell:
    return Cell("n/a" if value is None else f"{value:.3f}")


def _bytes(value) -> Cell:
    if value is None:
        return Cell("n/a")
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if value >= 1024**power:
            return Cell(f"{value / 1024**power:.4g} {unit}")
    return Cell(f"{value:,} B")
