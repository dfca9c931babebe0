"""``kvsim simulate``: replay a trace through the SimPy simulator with the cost model."""

from __future__ import annotations

from pathlib import Path

import click

from kvsim.cli.errors import UserError, user_errors
from kvsim.cli.options import decisions_option, run_config_from, run_options
from kvsim.sim.cluster.routers import RouterError, make_router
from kvsim.sim.cluster.runner import pd_setup_of, run_cluster, scaling_of
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.clients import format_bench, run_with_clients
from kvsim.sim.run.config import RunConfig, load_run_trace, resolve
from kvsim.sim.run.distributed import require_ray
from kvsim.sim.run.outputs import format_summary
from kvsim.sim.run.run_dir import check_out_dir, staged_dir
from kvsim.sim.run.run_warnings import format_warnings
from kvsim.sim.run.runner import run_trace
from kvsim.traces.schema import Trace


def prepare(config: RunConfig):
    """Resolve the config and load its trace, reporting every input mistake as a UserError."""
    with user_errors():
        resolved = resolve(config)
        trace: Trace = load_run_trace(config)
        timer = CostModelTimer(resolved.cost_model())
        make_router(config.router, config.router_params)  # a router that cannot be built is the input's mistake
        scaling = scaling_of(resolved)  # ... or an autoscaler
        if pd_setup_of(resolved, scaling) is not None:  # ... or P/D pools that the topology cannot link
            make_router(config.decode_router, config.decode_router_params)
            if trace.has_parallel_samples:
                raise ValueError(f"prefill_instances: P/D pools serve one sample a request; {config.trace} has n_samples > 1")
    if config.api_server or config.max_concurrency:
        if config.is_cluster:
            raise UserError("--api-server, --max-concurrency: one instance for now (the clients of a cluster are not modelled)")
        if trace.has_parallel_samples:
            raise UserError(f"--api-server, --max-concurrency: trace {config.trace} has requests of n > 1 samples, "
                            "which the benchmark client does not send")
    return resolved, trace, timer


@click.command()
@run_options
@click.option("--check", is_flag=True, help="Verify the engine's invariants and every plan after every step (slow).")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Run directory.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists and is not empty.")
@click.option("--quiet", is_flag=True, help="No progress bar or summary table.")
@decisions_option("summary")
def simulate(out_dir: Path, check: bool, overwrite: bool, quiet: bool, decisions: str,
             **options) -> None:
    """Replay a trace through the simulator; write summary.json, requests.csv, steps.csv and the decision log.

    The run directory appears only when complete (it holds a COMPLETE marker).
    """
    config = run_config_from(options)
    with user_errors():
        check_out_dir(out_dir, overwrite)
        if config.cluster_workers and config.cluster_backend == "ray":
            require_ray()
    resolved, trace, timer = prepare(config)
    with user_errors():
        stage = staged_dir(out_dir, overwrite)
    try:
        with stage as tmp:  # a failure from here on is kvsim's (or a plugin's), not the input's
            if config.is_cluster:
                _, summary = run_cluster(resolved, trace, tmp, check=check, decisions=decisions)
            elif config.api_server or config.max_concurrency:  # the clients' sends, then the engine's run of them
                _, summary = run_with_clients(resolved, trace, timer, tmp, check=check, progress=not quiet, decisions=decisions)
            else:  # one instance: the router has nothing to choose
                _, summary = run_trace(resolved, trace, timer, tmp, check=check, progress=not quiet, decisions=decisions)
    except RouterError as exc:
        raise UserError(str(exc)) from None
    if not quiet:
        click.echo(format_summary(summary))
        if "bench" in summary:
            click.echo(format_bench(summary["bench"]))
    for line in format_warnings(summary["warnings"]):
        click.echo(line, err=True)
    click.echo(f"wrote {out_dir}")
