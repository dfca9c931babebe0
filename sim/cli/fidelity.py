"""``kvsim fidelity``: predicted vs published serving figures, with signed errors (sim/studies/fidelity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from kvsim.sim.studies.fidelity import (
    FIT_MAX_PASSES,
    FIT_TOLERANCE,
    HAND_FITTED,
    LENGTH_SOURCES,
    PARAMETERS,
    PUBLISHED,
    SUMMARIES,
    Result,
    Row,
    bundled_devices_for,
    dataset_lengths,
    evaluate,
    fit_to_fixed_point,
    get_parameter,
    leave_one_source_out,
    load_published,
    row_command,
    row_lengths,
    row_trace,
    runs_with_fit_rows,
    sharegpt_unavailable,
    summarize_errors,
    summarize_left_out,
)
from kvsim.traces.canonical import save as save_trace
from kvsim.traces.errors import FIDELITY_EXTRA


@click.command()
@click.option("--data", "data_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=PUBLISHED,
              show_default=True, help="Published-figures TOML.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("fidelity"),
              show_default=True, help="Where fidelity.json and fidelity.html go.")
@click.option("--fit/--no-fit", default=True, show_default=True,
              help="Solve the fit rows' parameters first (else: the device profiles as they are).")
@click.option("--only", default="", help="Only rows whose id starts with this.")
@click.option("--lengths", type=click.Choice(LENGTH_SOURCES), default="auto", show_default=True,
              help="ShareGPT rows' lengths: vLLM's draw from the [fidelity] extra's ShareGPT file (as drawn, or "
              "scaled to the published totals), or lognormal at the published totals; auto: sharegpt where the extra "
              "is installed.")
@click.option("--leave-one-source-out/--no-leave-one-source-out", "loso", default=True, show_default=True,
              help="With --fit: also predict each source's rows with every parameter fitted without that source's rows.")
@click.option("--fit-tolerance", type=click.FloatRange(min=0, min_open=True), default=FIT_TOLERANCE, show_default=True,
              help="The fit runs pass after pass until a pass moves no parameter by more than this (relative).")
@click.option("--max-fit-passes", type=click.IntRange(min=1), default=FIT_MAX_PASSES, show_default=True,
              help="At most this many fit passes; the output says whether the fit reached a fixed point.")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Worker processes: devices fitted, rows predicted and sources left out in parallel (the same results as one)  "
              "[default: one per core].")
def fidelity(data_path: Path, out_dir: Path, fit: bool, only: str, lengths: str, loso: bool, fit_tolerance: float,
             max_fit_passes: int, jobs: int | None) -> None:
    """Replay published vLLM / vllm-ascend measurements; print predicted vs measured and signed errors."""
    try:
        published = load_published(data_path)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    rows = [r for r in published.rows if r.id.startswith(only)]
    if not rows:
        raise click.ClickException(f"no row id starts with {only!r}")
    try:
        lengths_text = describe_lengths(rows, lengths)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    bundled = devices = bundled_devices_for(rows)
    convergence = fit_to_fixed_point(rows, devices, fit_tolerance, max_fit_passes, lengths=lengths, jobs=jobs) if fit else None
    if convergence:
        devices = convergence.devices
    results = evaluate(rows, devices, lengths, jobs)
    left_out = leave_one_source_out(rows, bundled, devices, results, fit_tolerance, max_fit_passes, lengths, jobs) if fit and loso else []
    loso_summary = summarize_left_out(left_out) if left_out else None
    fitted = {
        f"{r.device}:{r.fits}": {"row": r.id, "value": get_parameter(devices[r.device], r.fits)}
        for r in rows
        if r.solved_by_fit
    }
    fitted.update({r.fits: {"row": r.id, "value": float(eval_hand_fitted(r.fits))} for r in rows if r.fits in HAND_FITTED})
    fitted_runs = runs_with_fit_rows(rows)
    click.echo(format_table(results, fitted_runs))
    if lengths_text:
        click.echo(lengths_text)
    summary = {split: summarize_errors(results, split) for split in SUMMARIES}
    for split, s in summary.items():
        if s["rows"]:
            click.echo(f"{split}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, max |error| {s['max_abs_error']:.1%}")
    if loso_summary:
        click.echo(format_left_out(loso_summary))
    for name, f in fitted.items():
        click.echo(f"fitted {name} = {f['value']:.4g} (row {f['row']})")
    if convergence:
        click.echo(convergence.describe())
    out_dir.mkdir(parents=True, exist_ok=True)
    commands = row_commands(rows, out_dir / "traces", lengths)
    if not fit:
        click.echo("each row as a kvsim simulate command (the figure: summary.json's bench.<metric>):")
        for row_id, command in commands.items():
            click.echo(f"  {row_id}: {' '.join(command)}")
    left_out_by_id = {r.row.id: r for s in left_out for r in s.results}
    payload = {
        "data": str(data_path.name),
        "fitted": fitted,
        "fit_convergence": convergence.to_dict() if convergence else None,
        "parameters_searched": {k: list(v) for k, v in PARAMETERS.items()},
        "summary": summary,
        "leave_one_source_out": loso_summary,
        "sharegpt_lengths": {r.id: dataset_lengths(r, lengths) for r in rows if r.input_total},
        "sources": {s.id: {"url": s.url, "title": s.title} for s in published.sources.values()},
        "rows": [{**r.to_dict(), "same_run_as_a_fit_row": r.row.run in fitted_runs, "command": commands.get(r.row.id),
                  **_left_out_fields(left_out_by_id.get(r.row.id))} for r in results],
    }
    (out_dir / "fidelity.json").write_text(json.dumps(payload, indent=2))
    write_html(results, fitted_runs, summary, loso_summary, fitted, published.sources, out_dir / "fidelity.html")
    click.echo(f"wrote {out_dir / 'fidelity.json'} and {out_dir / 'fidelity.html'}")


def _left_out_fields(result: Result | None) -> dict:
    if result is None:
        return {}
    return {"left_out_predicted": result.predicted, "left_out_signed_error": result.signed_error}


def format_left_out(summary: dict) -> str:
    """The leave-one-source-out lines: each source with the parameters that fell back to a prior, then the headline."""
    lines = ["leave-one-source-out (each source's rows, every parameter fitted without them):"]
    for source, s in summary["per_source"].items():
        lines.append(f"  {source}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, max {s['max_abs_error']:.1%}")
        for name, prior in s["priors"].items():
            lines.append(f"    no other source fits {name}: {prior['value']:.4g} ({prior['from']})")
        for name in s["hand_fitted_kept"]:
            lines.append(f"    {name}: hand-fitted on this source, kept (not left out)")
        for device, refit in s["refits"].items():
            state = "a fixed point" if refit["converged"] else "NOT a fixed point"
            lines.append(f"    {device} fitted again without it: {state} after {refit['passes']} passes")
    lines.append(
        f"leave-one-source-out: {summary['rows']} rows from {summary['sources']} sources, "
        f"median |error| {summary['median_abs_error']:.1%}, max |error| {summary['max_abs_error']:.1%}"
    )
    return "\n".join(lines)


def row_commands(rows: list[Row], trace_dir: Path, lengths: str) -> dict[str, list[str]]:
    """Each served row's requests written to ``trace_dir``, and the ``kvsim simulate`` command that replays
    them on the bundled device (the ``--no-fit`` figure; with ``--fit`` the device's fitted parameters differ)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    commands = {}
    for row in rows:
        path = trace_dir / f"{row.id}.jsonl"
        command = row_command(row, str(path))
        if command is not None:
            save_trace(row_trace(row, lengths), path)
            commands[row.id] = command
    return commands


def describe_lengths(rows: list[Row], lengths: str) -> str:
    """Where the ShareGPT rows' lengths came from, and each sample's lengths beside the published totals.

    The sources give only totals (no percentiles); a sample drawn from the cut-off file has its own.
    """
    dataset_rows = [r for r in rows if r.input_total]
    if not dataset_rows:
        return ""
    runs: dict[tuple, Row] = {}
    for r in dataset_rows:
        runs.setdefault((r.model, r.num_prompts, r.seed, r.input_total, r.output_total), r)
    lines = ["ShareGPT rows' lengths:"]
    for r in runs.values():
        source = dataset_lengths(r, lengths)
        prompts, outputs = row_lengths(r, lengths)
        why = f" ({sharegpt_unavailable(r.model) or '--lengths lognormal'})" if source == "lognormal" else ""
        lines.append(f"  {r.model}, {r.num_prompts} prompts, seed {r.seed}: {source}{why}")
        for name, column, published in (("prompt", prompts, r.input_total), ("output", outputs, r.output_total)):
            p50, p90, p99 = np.percentile(column, [50, 90, 99])
            lines.append(
                f"    {name}: p50 {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, mean {column.mean():.1f}, total {int(column.sum()):,}"
                f" (published total {published:,}, {column.sum() / published - 1:+.1%})"
            )
    if any(dataset_lengths(r, lengths) == "lognormal" for r in dataset_rows) and lengths == "auto":
        lines.append(f"  lognormal lengths are the fallback; for vLLM's own ShareGPT draw: {FIDELITY_EXTRA}")
    return "\n".join(lines)


def eval_hand_fitted(name: str) -> float:
    """The current value of a hand-fitted constant (``module.NAME`` in :data:`HAND_FITTED`)."""
    import importlib

    module, attr = HAND_FITTED[name].rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def split_label(result: Result, fitted_runs: set) -> str:
    """``check*`` marks a check row of a run that a fit row also comes from (not independent)."""
    return "check*" if result.row.split == "check" and result.row.run in fitted_runs else result.row.split


def format_table(results: list[Result], fitted_runs: set) -> str:
    width = max([26, *(len(r.row.id) + 1 for r in results)])
    lines = [f"{'row':<{width}}{'split':<7}{'metric':<19}{'measured':>11}{'predicted':>11}{'error':>8}  source"]
    for r in results:
        lines.append(
            f"{r.row.id:<{width}}{split_label(r, fitted_runs):<7}{r.row.metric:<19}{r.row.measured:>11.4g}{r.predicted:>11.4g}"
            f"{r.signed_error:>+8.1%}  {r.row.source}"
        )
    lines.append("check*: a figure of a run that a fit row also comes from (not counted as independent)")
    return "\n".join(lines)


def write_html(results: list[Result], fitted_runs: set, summary: dict, loso: dict | None, fitted: dict, sources: dict,
               path: Path) -> Path:
    from kvsim.reports.page import Cell, Page  # plotly: only the HTML page needs it

    page = Page("kvsim fidelity: predicted vs published serving measurements")
    for name in ("check", "independent check"):
        check = summary[name]
        if check["rows"]:
            passed = check["median_abs_error"] <= 0.10 and check["max_abs_error"] <= 0.25
            page.banner(
                f"{name} rows ({check['rows']}): median |error| {check['median_abs_error']:.1%}, max {check['max_abs_error']:.1%} "
                f"(target: median <= 10 %, none beyond 25 %)",
                passed,
            )
    if loso:
        page.banner(f"leave-one-source-out ({loso['rows']} rows, {loso['sources']} sources): median |error| "
                    f"{loso['median_abs_error']:.1%}, max {loso['max_abs_error']:.1%} (target: median <= 12 %)",
                    loso["median_abs_error"] <= 0.12)
    for split in ("check", "check*", "fit"):
        page.heading(f"{split} rows" if split != "check*" else "check rows of runs a fit row also comes from")
        rows = []
        for r in (x for x in results if split_label(x, fitted_runs) == split):
            err = r.signed_error
            css = "pass" if abs(err) <= 0.10 else "diff" if abs(err) <= 0.25 else "fail"
            configuration = f"{r.row.model} on {r.row.device}, {r.row.engine}, {r.row.workload}"
            rows.append([r.row.id, Cell(r.row.metric, "text"), f"{r.row.measured:.4g}", f"{r.predicted:.4g}", Cell(f"{err:+.1%}", css),
                         Cell(configuration, "text"), Cell(r.row.source, "text"), Cell(r.row.fits, "text")])  # fmt: skip
        page.table(["row", "metric", "measured", "predicted", "signed error", "configuration", "source", "fits"], rows)
    if loso:
        page.heading("leave-one-source-out: each source's rows, every parameter fitted without them")
        page.table(["source", "rows", "median |error|", "max |error|", "parameters no other source fits (value, from)"],
                   [[source, s["rows"], f"{s['median_abs_error']:.1%}", f"{s['max_abs_error']:.1%}",
                     Cell("; ".join([f"{k} = {v['value']:.4g} ({v['from']})" for k, v in s["priors"].items()]
                                    + [f"{k}: hand-fitted here, kept" for k in s["hand_fitted_kept"]]), "text")]
                    for source, s in loso["per_source"].items()])
    page.heading("fitted parameters")
    page.table(["parameter", "value", "fitted on row"], [[name, f"{f['value']:.4g}", f["row"]] for name, f in fitted.items()])
    page.heading("sources")
    page.table(["id", "title", "url"], [[s.id, Cell(s.title, "text"), Cell(s.url, "text")] for s in sources.values()])
    return page.write(path)
