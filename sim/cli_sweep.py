"""``kvsim sweep``: a grid of what-if simulations on local processes or a Ray cluster."""

from __future__ import annotations

from pathlib import Path

import click
from tqdm import tqdm

from kvsim.sim.sweep import expand_grid, load_sweep, run_sweep


@click.command()
@click.argument("sweep_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--jobs", type=int, default=None, help="Local worker processes (default: one per core).")
@click.option("--quiet", is_flag=True)
def sweep(sweep_file: Path, out_dir: Path, backend: str, jobs: int | None, quiet: bool) -> None:
    """Run every configuration of SWEEP_FILE's [grid]; one run directory each, plus sweep.csv."""
    try:
        base, grid = load_sweep(sweep_file)
        total = sum(1 for _ in expand_grid(base, grid))
        with tqdm(total=total, desc="sweep", unit="run", disable=quiet) as bar:
            path = run_sweep(base, grid, out_dir, backend=backend, jobs=jobs, on_done=lambda _: bar.update())
    except (ValueError, KeyError) as exc:
        raise click.ClickException(str(exc).strip("'\"")) from None
    click.echo(f"wrote {path}")
