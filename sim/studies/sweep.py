"""What-if sweeps: a grid of run configurations, each one independent simulation.

A sweep file is a run configuration TOML plus a ``[grid]`` table whose keys are RunConfig
fields (or vLLM's names for them) and whose values are lists; the sweep runs the cartesian
product::

    trace = "azure_conv_10min"
    model = "llama-2-7b"
    [grid]
    block_size = [16, 128]
    kv_cache_dtype = ["bf16", "int8"]
    request_rate = [1.0, 2.0]

A key that names several fields, comma-separated, varies them together: its values are lists
with one value per field (``"tensor_parallel_size,data_parallel_size" = [[8, 2], [16, 1]]``:
two layouts of 16 devices, not four combinations).

Runs go to local worker processes by default, or to a Ray cluster (``backend="ray"``,
``pip install 'kvsim[dist]'``); either way each run writes its own directory and one row
of ``sweep.csv``, with one column per varied setting; a point that fails is a row with its
error, and the others still run.
"""

from __future__ import annotations

import csv
import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from kvsim.sim.run.config import VLLM_KEYS, RunConfig, config_fields
from kvsim.sim.run.distributed import connected_ray
from kvsim.sim.run.run_dir import staged_dir
from kvsim.sim.toml_io import load_toml

HEADLINE = ("requests_completed", "requests_rejected", "throughput_tok_s", "preemptions", "prefix_hit_rate",
            "num_kv_blocks", "peak_kv_blocks_used", "mean_kv_usage", "wall_s")
LATENCIES = ("ttft_s", "tpot_s", "e2e_s")


def load_grid_file(path: str | Path, require_grid: bool = True) -> tuple[RunConfig, dict[str, list], dict]:
    """A run config TOML with a ``[grid]`` of lists: (base config, grid, the file's other tables).

    Grid keys keep the user's spelling (vLLM names too); every value is type-checked.
    """
    data = load_toml(path)
    grid = data.pop("grid", None if require_grid else {})
    if not isinstance(grid, dict) or (require_grid and not grid):
        raise ValueError(f"{path}: needs a [grid] table of RunConfig fields to vary")
    extra = {k: data.pop(k) for k in list(data) if isinstance(data[k], dict) and k not in ("scheduler_params", "block_manager_params")}
    base = RunConfig(**config_fields(data, str(path)))
    not_lists = [k for k, v in grid.items() if not isinstance(v, list) or not v]
    if not_lists:
        raise ValueError(f"{path}: [grid] values must be non-empty lists: {not_lists}")
    for key, values in grid.items():
        fields = key.split(",")
        for value in values:
            if len(fields) > 1 and (not isinstance(value, list) or len(value) != len(fields)):
                raise ValueError(f"{path}: [grid] {key}: every value must list {len(fields)} values, one per field; got {value!r}")
            config_fields(dict(zip(fields, value)) if len(fields) > 1 else {key: value}, f"{path} [grid]")
    return base, grid, extra


def load_sweep(path: str | Path) -> tuple[RunConfig, dict[str, list]]:
    base, grid, extra = load_grid_file(path)
    if extra:
        raise ValueError(f"{path}: unknown table(s) {sorted(extra)}; a sweep has [grid], [scheduler_params], [block_manager_params]")
    return base, grid


def expand_grid(base: RunConfig, grid: dict[str, list]) -> Iterator[tuple[str, dict, RunConfig]]:
    """(name, varied settings, config) for every combination, named like ``block_size=16,kv_dtype=int8``."""
    keys = sorted(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        settings = {}
        for key, value in zip(keys, values):  # a joint key ("a,b") sets its fields together
            settings.update(zip(key.split(","), value) if "," in key else [(key, value)])
        name = ",".join(f"{k}={v}" for k, v in settings.items())
        yield name, settings, base.updated(**{VLLM_KEYS.get(k, k): v for k, v in settings.items()})


def run_one(name: str, settings: dict, config: RunConfig, out_dir: str) -> dict:
    """One simulation of the sweep (a worker process or a Ray task): its row of sweep.csv.

    A point that fails (bad combination, plugin error) is recorded with its error; the
    sweep goes on.
    """
    from kvsim.sim.cluster.runner import run_cluster
    from kvsim.sim.perf.cost_model import CostModelTimer
    from kvsim.sim.run.clients import run_with_clients
    from kvsim.sim.run.config import load_run_trace, resolve
    from kvsim.sim.run.runner import run_trace

    row: dict = {"name": name, **settings}
    try:
        resolved = resolve(config)
        trace = load_run_trace(config)
        with staged_dir(Path(out_dir) / point_dir_name(name)) as tmp:
            if config.is_cluster:  # as kvsim simulate runs it: instances behind the router
                _, summary = run_cluster(resolved, trace, tmp)
            else:
                clients = config.api_server or config.max_concurrency
                timer = CostModelTimer(resolved.cost_model())
                _, summary = (run_with_clients if clients else run_trace)(resolved, trace, timer, tmp)
    except Exception as exc:  # recorded in sweep.csv: one bad point must not lose the others
        return {**row, "status": "failed", "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
    row.update({"status": "ok", "error": ""})
    row.update({k: summary[k] for k in HEADLINE})
    for metric in LATENCIES:
        row[f"{metric}_p50"] = summary[metric]["p50"]
        row[f"{metric}_p99"] = summary[metric]["p99"]
    row["warnings"] = ";".join(w["kind"] for w in summary["warnings"])
    row.update({f"bench_{k}": v for k, v in summary.get("bench", {}).items() if k not in ("api_server", "max_concurrency")})
    return row


SWEEP_CSV = "sweep.csv"


def point_dir_name(name: str) -> str:
    """The directory of a sweep point inside the sweep directory."""
    return name.replace("/", "_").replace(":", "_")


def run_sweep(base: RunConfig, grid: dict[str, list], out_dir: Path, *, backend: str = "local", jobs: int | None = None,
              on_done: Callable[[dict], None] | None = None, overwrite: bool = False) -> Path:
    """Run every configuration and write ``out_dir/sweep.csv`` (rows in grid order, one column
    per varied setting). ``out_dir`` appears only once every point has run."""
    points = list(expand_grid(base, grid))
    with staged_dir(out_dir, overwrite) as tmp:
        tasks = [(name, settings, config, str(tmp)) for name, settings, config in points]
        rows = parallel_map(run_one, tasks, backend=backend, jobs=jobs, on_done=on_done)
        columns = list(dict.fromkeys(k for row in rows for k in row))
        with (tmp / SWEEP_CSV).open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
    return out_dir / SWEEP_CSV


def parallel_map(fn: Callable, tasks: list[tuple], *, backend: str = "local", jobs: int | None = None,
                 on_done: Callable | None = None) -> list:
    """``[fn(*t) for t in tasks]`` on local worker processes or Ray tasks, results in task order."""
    if backend == "ray":
        results = _run_ray(fn, tasks, on_done)
    elif backend == "local":
        results = _run_local(fn, tasks, jobs or os.cpu_count() or 1, on_done)
    else:
        raise ValueError(f"unknown backend {backend!r} (local or ray)")
    return [results[i] for i in range(len(tasks))]


def _run_local(fn: Callable, tasks: list[tuple], jobs: int, on_done) -> dict[int, object]:
    results: dict[int, object] = {}
    if jobs == 1 or len(tasks) == 1:
        for i, task in enumerate(tasks):
            results[i] = fn(*task)
            if on_done:
                on_done(results[i])
        return results
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
        futures = {pool.submit(fn, *task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if on_done:
                on_done(results[futures[future]])
    return results


def _run_ray(fn: Callable, tasks: list[tuple], on_done) -> dict[int, object]:
    ray = connected_ray()
    remote = ray.remote(fn)
    pending = {remote.remote(*task): i for i, task in enumerate(tasks)}
    results: dict[int, object] = {}
    waiting = list(pending)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1)
        results[pending[done[0]]] = ray.get(done[0])
        if on_done:
            on_done(results[pending[done[0]]])
    return results
