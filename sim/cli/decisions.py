"""``kvsim decisions``: read a run's decision log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvsim.cli.errors import UserError
from kvsim.sim.run.decisions import read_decisions, read_digest


@click.group()
def decisions() -> None:
    """Read a run's decision log (written with --decisions full, or a digest with summary)."""


@decisions.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--per-step", is_flag=True, help="Expand the decode-stretch records of older logs into one line per step too.")
def show(run_dir: Path, per_step: bool) -> None:
    """Print RUN_DIR's decision log as JSON lines, one per step (older logs: or decode stretch)."""
    try:
        lines = read_decisions(run_dir, per_step=per_step)
        out = sys.stdout
        for line in lines:
            out.write(line + "\n")
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from None


@decisions.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def digest(run_dir: Path) -> None:
    """Print RUN_DIR's decision digest (counts and SHA-256; equal digests, equal decisions)."""
    try:
        click.echo(json.dumps(read_digest(run_dir), indent=1))
    except FileNotFoundError:
        raise UserError(f"{run_dir}: no decision digest (run with --decisions summary or full)") from None
