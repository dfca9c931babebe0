"""What-if sweeps: a grid of run configurations, each one independent simulation.

A sweep file is a run configuration TOML plus a ``[grid]`` table whose keys are RunConfig
fields and whose values are lists; the sweep runs the cartesian product::

    trace = "azure_conv_10min"
    model = "llama-2-7b"
    [grid]
    block_size = [16, 128]
    kv_dtype = ["bf16", "int8"]
    rate_scale = [1.0, 2.0]

Runs go to local worker processes by default, or to a Ray cluster (``backend="ray"``,
``pip install 'kvsim[dist]'``); either way each run writes its own directory and one row
of ``sweep.csv``.
"""

from __future__ import annotations

import csv
import itertools
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import fields
from pathlib import Path
from typing import Callable, Iterator

from kvsim.sim.run_config import RunConfig
from kvsim.sim.toml_io import load_toml

HEADLINE = ("requests_completed", "requests_rejected", "throughput_tok_s", "preemptions", "prefix_hit_rate",
            "num_kv_blocks", "peak_kv_blocks_used", "mean_kv_usage", "wall_s")
LATENCIES = ("ttft_s", "tpot_s", "e2e_s")


def load_sweep(path: str | Path) -> tuple[RunConfig, dict[str, list]]:
    data = load_toml(path)
    grid = data.pop("grid", None)
    if not grid:
        raise ValueError(f"{path}: a sweep needs a [grid] table of RunConfig fields to vary")
    allowed = {f.name for f in fields(RunConfig)}
    unknown = sorted((set(data) | set(grid)) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    not_lists = [k for k, v in grid.items() if not isinstance(v, list) or not v]
    if not_lists:
        raise ValueError(f"{path}: [grid] values must be non-empty lists: {not_lists}")
    return RunConfig(**data), grid


def expand_grid(base: RunConfig, grid: dict[str, list]) -> Iterator[tuple[str, RunConfig]]:
    """(name, config) for every combination, named like ``block_size=16,kv_dtype=int8``."""
    keys = sorted(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        overrides = dict(zip(keys, values))
        name = ",".join(f"{k}={v}" for k, v in overrides.items())
        yield name, base.updated(**overrides)


def run_one(name: str, config: RunConfig, out_dir: str) -> dict:
    """One simulation of the sweep (runs in a worker process or a Ray task)."""
    from kvsim.sim.cost_model import CostModelTimer
    from kvsim.sim.run_config import load_run_trace, resolve
    from kvsim.sim.runner import run_trace

    resolved = resolve(config)
    timer = CostModelTimer(resolved.cost_model())
    _, summary = run_trace(resolved, load_run_trace(config), timer, Path(out_dir) / _safe(name))
    row = {"name": name, **{k: summary[k] for k in HEADLINE}}
    for metric in LATENCIES:
        row[f"{metric}_p50"] = summary[metric]["p50"]
        row[f"{metric}_p99"] = summary[metric]["p99"]
    return row


def _safe(name: str) -> str:
    return name.replace("/", "_").replace(":", "_")


def run_sweep(base: RunConfig, grid: dict[str, list], out_dir: Path, *, backend: str = "local", jobs: int | None = None,
              on_done: Callable[[dict], None] | None = None) -> Path:
    """Run every configuration and write ``out_dir/sweep.csv`` (rows in grid order)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = list(expand_grid(base, grid))
    if backend == "ray":
        rows = _run_ray(configs, out_dir, on_done)
    elif backend == "local":
        rows = _run_local(configs, out_dir, jobs or os.cpu_count() or 1, on_done)
    else:
        raise ValueError(f"unknown sweep backend {backend!r} (local or ray)")
    order = {name: i for i, (name, _) in enumerate(configs)}
    rows.sort(key=lambda r: order[r["name"]])
    path = out_dir / "sweep.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _run_local(configs, out_dir: Path, jobs: int, on_done) -> list[dict]:
    rows = []
    if jobs == 1:
        for name, config in configs:
            rows.append(run_one(name, config, str(out_dir)))
            if on_done:
                on_done(rows[-1])
        return rows
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_one, name, config, str(out_dir)) for name, config in configs]
        for future in as_completed(futures):
            rows.append(future.result())
            if on_done:
                on_done(rows[-1])
    return rows


def _run_ray(configs, out_dir: Path, on_done) -> list[dict]:
    try:
        import ray
    except ImportError:
        raise ValueError("the ray backend needs Ray: pip install 'kvsim[dist]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    task = ray.remote(run_one)
    pending = [task.remote(name, config, str(out_dir)) for name, config in configs]
    rows = []
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rows.append(ray.get(done[0]))
        if on_done:
            on_done(rows[-1])
    return rows
