"""``kvsim capacity``: the highest request rate each configuration of a grid serves within SLOs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import click
from tqdm import tqdm

from kvsim.cli.errors import user_errors
from kvsim.sim.run.run_dir import check_out_dir, staged_dir
from kvsim.sim.studies.capacity import Capacity, Slo, search
from kvsim.sim.studies.sweep import expand_grid, load_grid_file, parallel_map

SLO_KEYS = ("ttft_s", "tpot_s", "e2e_s", "percentile")


def load_capacity_file(path: Path, flags: dict) -> tuple[list[tuple[str, dict, object]], Slo]:
    """The grid's configurations and the SLO: the file's ``[slo]`` table with ``flags`` on top."""
    base, grid, extra = load_grid_file(path, require_grid=False)
    slo_table = extra.pop("slo", {})
    if extra:
        raise ValueError(f"{path}: unknown table(s) {sorted(extra)}; a capacity file has [grid], [slo] and policy parameters")
    unknown = sorted(set(slo_table) - set(SLO_KEYS))
    if unknown:
        raise ValueError(f"{path} [slo]: unknown key(s) {unknown}; allowed: {list(SLO_KEYS)}")
    for key, value in slo_table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path} [slo]: {key} = {value!r}: expected a number")
    varied = {"request_rate", "rate_scale"} & set(grid)
    if varied:
        raise ValueError(f"{path} [grid]: capacity searches the rate itself; do not vary {sorted(varied)}")
    points = list(expand_grid(base, grid))
    if any(config.api_server or config.max_concurrency for _, _, config in points):
        raise ValueError(f"{path}: api_server / max_concurrency: capacity searches open-loop arrival rates against "
                         "engine-side latencies; the benchmark client is in simulate and sweep")
    slo = Slo(**{**slo_table, **{k: v for k, v in flags.items() if v is not None}})
    return points, slo


@click.command()
@click.argument("grid_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Writes capacity.csv, capacity.json, capacity.html.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists and is not empty.")
@click.option("--slo-ttft", "ttft_s", type=float, help="TTFT objective (s) [default: the file's [slo] ttft_s].")
@click.option("--slo-tpot", "tpot_s", type=float, help="TPOT objective (s) [default: the file's [slo] tpot_s].")
@click.option("--slo-e2e", "e2e_s", type=float, help="End-to-end latency objective (s) [default: the file's [slo] e2e_s].")
@click.option("--percentile", type=float, help="Percentile the objectives hold at [default: the file's, else 99].")
@click.option("--tolerance", type=click.FloatRange(0.001, 1.0), default=0.02, show_default=True,
              help="Stop when the rate that misses is within this fraction of the rate that meets.")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--jobs", type=int, default=None, help="Local worker processes [default: one per core].")
@click.option("--quiet", is_flag=True)
def capacity(grid_file: Path, out_dir: Path, overwrite: bool, tolerance: float, backend: str, jobs: int | None, quiet: bool,
             **slo_flags) -> None:
    """For each configuration of GRID_FILE (a run config TOML, optionally with a [grid] like
    `kvsim sweep` and an [slo] table), find the highest request rate meeting the SLOs by
    bisection on the trace's arrival process scaled in rate; print a table, write CSV, JSON
    and a plot."""
    with user_errors():
        points, slo = load_capacity_file(grid_file, slo_flags)
        check_out_dir(out_dir, overwrite)
    tasks = [(name, settings, config, slo, tolerance) for name, settings, config in points]
    with tqdm(total=len(tasks), desc="capacity", unit="config", disable=quiet) as bar, user_errors():
        results: list[Capacity] = parallel_map(search, tasks, backend=backend, jobs=jobs, on_done=lambda _: bar.update())
        with staged_dir(out_dir, overwrite) as tmp:
            write_capacity(tmp, results, slo)
    click.echo(format_table(results, slo))
    for result in results:
        if result.error:
            click.echo(f"warning: {result.name or 'the configuration'} failed: {result.error}", err=True)
    click.echo(f"wrote {out_dir}")


def write_capacity(out_dir: Path, results: list[Capacity], slo: Slo) -> None:
    rows = [r.row() for r in results]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with (out_dir / "capacity.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    data = {"slo": {**slo.__dict__, "description": slo.describe()}, "configs": [r.to_dict() for r in results]}
    (out_dir / "capacity.json").write_text(json.dumps(data, indent=1) + "\n")
    try:
        from kvsim.reports.capacity import capacity_page
    except ImportError:  # plotly is the reports extra's; the table and CSV do without it
        return
    capacity_page(data).write(out_dir / "capacity.html")


def format_table(results: list[Capacity], slo: Slo) -> str:
    width = max([len(r.name) for r in results] + [13])
    lines = [f"capacity within {slo.describe()}",
             f"{'configuration':<{width}}  {'req/s':>9}  {'goodput':>9}  {'x trace':>8}  {'probes':>6}"]
    for r in results:
        best = r.at_capacity
        goodput = f"{best.goodput_rps:9.3f}" if best and best.goodput_rps is not None else f"{'-':>9}"
        ratio = f"{r.capacity_rps / r.trace_rate_rps:8.2f}" if r.trace_rate_rps else f"{'-':>8}"
        note = "  failed" if r.error else ("  (never missed)" if r.bracket[1] is None and not r.error else "")
        lines.append(f"{r.name or 'config':<{width}}  {r.capacity_rps:9.3f}  {goodput}  {ratio}  {len(r.probes):>6}{note}")
    return "\n".join(lines)
