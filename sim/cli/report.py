"""``kvsim report``: HTML reports from run directories and from ``kvsim validate``'s JSON."""

from __future__ import annotations

from pathlib import Path

import click

from kvsim.cli.errors import UserError
from kvsim.reports.cluster import cluster_page
from kvsim.reports.compare import Slo, write_compare_report
from kvsim.reports.runs import ReportInputError, read_json
from kvsim.reports.validation import RUN_NAMES, missing_keys, write_validation_report


@click.group("report")
def report() -> None:
    """HTML reports from simulate/execute runs (self-contained: open them offline)."""


@report.command("compare")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--label", "labels", multiple=True, help="A name per run, in order (default: the config fields that differ).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Writes compare.html and compare.json here.")
@click.option("--slo-ttft", type=float, default=Slo.ttft_s, show_default=True, help="TTFT objective (s) for goodput.")
@click.option("--slo-tpot", type=float, default=Slo.tpot_s, show_default=True, help="TPOT objective (s) for goodput.")
def compare(run_dirs: tuple[Path, ...], labels: tuple[str, ...], out_dir: Path, slo_ttft: float, slo_tpot: float) -> None:
    """Compare policies: throughput vs latency, goodput, KV usage, prefix hits, preemptions, rejections.

    RUN_DIRS are `kvsim simulate`/`execute` run directories; a `kvsim sweep` directory stands
    for every point of it that ran."""
    try:
        html_path, json_path = write_compare_report(list(run_dirs), out_dir, list(labels) or None, Slo(slo_ttft, slo_tpot))
    except ReportInputError as exc:
        raise UserError(str(exc)) from None
    click.echo(f"wrote {html_path} and {json_path}")


@report.command("cluster")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help="HTML file to write.")
def cluster(run_dir: Path, out_path: Path) -> None:
    """Load per instance, KV usage and instances over time of a cluster run (simulate --instances N)."""
    try:
        written = cluster_page(run_dir).write(out_path)
    except ReportInputError as exc:
        raise UserError(str(exc)) from None
    click.echo(f"wrote {written}")


@report.command("validation")
@click.argument("validation_json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help="HTML file to write.")
def validation(validation_json: Path, out_path: Path) -> None:
    """Re-render a validation report; the run directories real/ and sim/ (and replay/) lie beside the JSON."""
    try:
        data = read_json(validation_json)
        missing = missing_keys(data)
        if missing:
            raise ReportInputError(f"{validation_json}: not a kvsim validation result (missing {', '.join(missing)})")
        base = validation_json.parent
        run_dirs = {name: base / name for name in RUN_NAMES if (base / name).exists()}
        for name in ("real", "sim"):
            run_dirs.setdefault(name, base / name)  # a missing one fails below, naming its path
        written = write_validation_report(data, run_dirs, out_path)
    except ReportInputError as exc:
        raise UserError(str(exc)) from None
    click.echo(f"wrote {written}")
