"""``kvsim sweep``: a grid of what-if simulations on local processes or a Ray cluster."""

from __future__ import annotations

from pathlib import Path

import click
from tqdm import tqdm

from kvsim.cli.errors import user_errors
from kvsim.sim.run.run_dir import check_out_dir
from kvsim.sim.studies.sweep import expand_grid, load_sweep, run_sweep


@click.command()
@click.argument("sweep_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Sweep directory (sweep.csv, one run directory per point).")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists and is not empty.")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--jobs", type=int, default=None, help="Local worker processes [default: one per core].")
@click.option("--quiet", is_flag=True)
def sweep(sweep_file: Path, out_dir: Path, overwrite: bool, backend: str, jobs: int | None, quiet: bool) -> None:
    """Run every configuration of SWEEP_FILE's [grid]; one run directory each, plus sweep.csv."""
    with user_errors():
        base, grid = load_sweep(sweep_file)
        check_out_dir(out_dir, overwrite)
    total = sum(1 for _ in expand_grid(base, grid))
    failed: list[dict] = []

    def done(row: dict) -> None:
        bar.update()
        if row["status"] != "ok":
            failed.append(row)

    with tqdm(total=total, desc="sweep", unit="run", disable=quiet) as bar, user_errors():
        path = run_sweep(base, grid, out_dir, backend=backend, jobs=jobs, on_done=done, overwrite=overwrite)
    for row in failed:
        click.echo(f"warning: point {row['name']} failed: {row['error']}", err=True)
    click.echo(f"wrote {path}" + (f" ({len(failed)} of {total} points failed)" if failed else ""))
