"""``kvsim simulate``: replay a trace through the SimPy simulator with the cost model."""

from __future__ import annotations

from pathlib import Path

import click

from kvsim.sim.cli_options import run_config_from, run_options
from kvsim.sim.cost_model import CostModelTimer
from kvsim.sim.outputs import format_summary
from kvsim.sim.run_config import load_run_trace, resolve
from kvsim.sim.runner import run_trace


@click.command()
@run_options
@click.option("--exact", is_flag=True, default=None, help="Step one engine step at a time (no macro-stepping).")
@click.option("--check", is_flag=True, help="Verify the engine's invariants after every step (slow).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path), help="Run directory.")
@click.option("--quiet", is_flag=True, help="No progress bar or summary table.")
def simulate(out_dir: Path, exact: bool | None, check: bool, quiet: bool, **options) -> None:
    """Replay a trace through the simulator; write summary.json, requests.csv, steps.csv, decisions.jsonl."""
    try:
        config = run_config_from(options).updated(exact=exact)
        resolved = resolve(config)
        trace = load_run_trace(config)
        timer = CostModelTimer(resolved.cost_model())
    except (ValueError, KeyError) as exc:
        raise click.ClickException(str(exc).strip("'\"")) from None
    _, summary = run_trace(resolved, trace, timer, out_dir, check=check, progress=not quiet)
    if not quiet:
        click.echo(format_summary(summary))
    click.echo(f"wrote {out_dir}")
