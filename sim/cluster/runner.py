"""A cluster run's directory: the cluster's files as a single run writes them, instances beside.

``summary.json`` (the cluster's figures, ``instances`` and ``router`` within), ``requests.csv``
with an ``instance`` column, ``steps.csv`` with one too (every instance's steps, by end time);
``instances/<i>/`` holds each instance's decision digest (or log) when one is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kvsim.sim.cluster.autoscaler import DEFAULT_LOAD_BANDWIDTH, make_autoscaler
from kvsim.sim.cluster.cluster import ClusterRun, ClusterSimulation, Scaling
from kvsim.sim.cluster.disagg import PDClusterSimulation, PDSetup
from kvsim.sim.cluster.kv_transfer import KVMover, place_pools
from kvsim.sim.cluster.partitioned import Outputs, PartitionedCluster
from kvsim.sim.cluster.routers import Router, make_router
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.perf.step_timer import StepTimer
from kvsim.sim.run.config import ResolvedRun, RunConfig, resolve
from kvsim.sim.run.outputs import write_summary
from kvsim.sim.run.run_warnings import run_warnings
from kvsim.sim.run.simulator import SimOptions
from kvsim.traces.schema import Trace

SCALING_KEYS = ("min_instances", "max_instances", "interval_s", "load_bandwidth", "start_s")


def scaling_of(resolved: ResolvedRun) -> Scaling | None:
    """The run's autoscaler with its bounds and cold start, from ``autoscaler`` / ``autoscaler_params``."""
    config = resolved.config
    if not config.autoscaler:
        return None
    params = dict(config.autoscaler_params)
    bounds = {key: params.pop(key) for key in SCALING_KEYS if key in params}
    default_max = 4 * (max(config.prefill_instances, config.decode_instances) if config.disaggregated else config.instances)
    return Scaling(make_autoscaler(config.autoscaler, params), int(bounds.get("min_instances", 1)),
                   int(bounds.get("max_instances", default_max)), float(bounds.get("interval_s", 10.0)),
                   cold_start_s(resolved, config))


def cold_start_s(resolved: ResolvedRun, config: RunConfig) -> float:
    """A new instance's start: its weights (one rank's) read at ``load_bandwidth``, plus ``start_s``."""
    params = config.autoscaler_params
    load_bandwidth = float(params.get("load_bandwidth", DEFAULT_LOAD_BANDWIDTH))
    if load_bandwidth <= 0:
        raise ValueError(f"autoscaler_params.load_bandwidth must be > 0, got {load_bandwidth}")
    return resolved.memory.weight_bytes / load_bandwidth + float(params.get("start_s", 0.0))


def pd_setup_of(resolved: ResolvedRun, scaling: Scaling | None = None) -> PDSetup | None:
    """The P/D pools (the decode pool with its own tensor parallel size), placed on the device's
    nodes with the links between them checked (with an autoscaler, every instance each pool may
    launch has its devices); None without P/D pools."""
    config = resolved.config
    if not config.disaggregated:
        return None
    if config.instances > 1:
        raise ValueError("prefill_instances / decode_instances replace instances: give one or the other "
                         f"(instances = {config.instances})")
    decode_tp = config.decode_tensor_parallel_size or config.tensor_parallel_size
    # The decode pool reads its KV from the prefill side's transfer and puts nothing in a shared store
    # (vllm-ascend's KV pool: consumer_is_to_put = false).
    decode = (resolved if decode_tp == config.tensor_parallel_size and not config.kv_store_gb
              else resolve(config.updated(tensor_parallel_size=decode_tp, kv_store_gb=0.0)))
    prefill_n, decode_n = pool_sizes(config, scaling)
    placement = place_pools(resolved.device.topology, resolved.device.name, prefill_n, resolved.layout.world_size,
                            decode_n, decode.layout.world_size, config.kv_link)
    return PDSetup(resolved, decode, placement, config.kv_connector)


def pool_sizes(config: RunConfig, scaling: Scaling | None) -> tuple[int, int]:
    """The instances each P/D pool may run: its size, or its autoscaler's maximum if larger."""
    top = scaling.max_instances if scaling else 0
    return max(config.prefill_instances, top), max(config.decode_instances, top)


def run_cluster(resolved: ResolvedRun, trace: Trace, out_dir: Path | None, *, router: Router | None = None,
                check: bool = False, decisions: str = "summary", timers: list[StepTimer] | None = None,
                mover: KVMover | None = None, summary_extras: Callable[[ClusterRun], dict] | None = None,
                ) -> tuple[ClusterRun, dict]:
    """The configured instances behind ``router`` (None: the configured one) and its autoscaler, or
    the P/D pools; with ``out_dir``, its files. ``timers`` (one an instance, the prefill pool's first)
    and ``mover`` replace the cost model's step times and the link model's transfers: a real P/D pair's
    executors and KV channel (realexec/pd_pair.py), or a replay of what they measured.
    ``summary_extras`` adds what only the caller knows to the summary."""
    config = resolved.config
    router = make_router(config.router, config.router_params) if router is None else router
    scaling = scaling_of(resolved)
    setup = pd_setup_of(resolved, scaling)
    instances = sum(pool_sizes(config, scaling)) if setup else max(config.instances, scaling.max_instances if scaling else 0)
    outputs = Outputs(check, decisions, out_dir)
    if config.cluster_workers:
        run = PartitionedCluster(trace, resolved, router, config.cluster_workers, config.router_staleness_s, outputs,
                                 config.cluster_backend).run()
    else:
        run = _one_loop(resolved, trace, router, setup, scaling, instances, outputs, timers, mover)
    summary = run.summary()
    if summary_extras is not None:
        summary.update(summary_extras(run))
    summary["trace"] = {"source": trace.source, "rows": len(trace), "notes": list(trace.notes)}
    summary["router"] = {"name": config.router, "instances": config.instances, "staleness_s": config.router_staleness_s}
    if config.cluster_workers:
        summary["router"].update(cluster_workers=config.cluster_workers, cluster_backend=config.cluster_backend)
    if setup is not None:
        summary["router"].update(instances=instances, decode_router=config.decode_router)
        summary["pd"].update(connector=config.kv_connector, kv_link=config.kv_link,
                             prefill_nodes=list(setup.placement.prefill_nodes), decode_nodes=list(setup.placement.decode_nodes))
    if scaling is not None:
        initial = config.prefill_instances + config.decode_instances if setup else config.instances
        summary["autoscaler"] = {"name": config.autoscaler, "min_instances": scaling.min_instances,
                                 "max_instances": scaling.max_instances, "interval_s": scaling.interval_s,
                                 "cold_start_s": scaling.cold_start_s,
                                 "launched": sum(t is not None for t in run.launched_s) - initial,
                                 "retired": sum(t is not None for t in run.retired_s)}
    summary["config"] = resolved.to_dict()
    summary["memory"] = resolved.memory.to_dict()  # each instance's
    summary["warnings"] = run_warnings(resolved, trace, summary, run.user_records())
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_summary(out_dir, summary)
        run.write_files(out_dir)
    return run, summary


def _one_loop(resolved: ResolvedRun, trace: Trace, router: Router, setup: PDSetup | None, scaling: Scaling | None,
              instances: int, outputs: Outputs, timers: list[StepTimer] | None = None,
              mover: KVMover | None = None) -> ClusterRun:
    """Every instance (or both P/D pools) in one event loop; ``timers``: the run_cluster's."""
    config = resolved.config
    logs = [outputs.decision_log(i, resolved.engine_config.block_size) for i in range(instances)]
    options = [SimOptions(check=outputs.check, decisions=log) for log in logs]
    try:
        if timers is not None and len(timers) != instances:
            raise ValueError(f"{len(timers)} step timers for {instances} instances")
        if setup is None:
            timers = timers or [CostModelTimer(resolved.cost_model()) for _ in range(instances)]
            return ClusterSimulation(trace, resolved, timers, router, config.router_staleness_s, options, scaling,
                                     initial_instances=config.instances).run()
        p, d = pool_sizes(config, scaling)
        timers = timers or [CostModelTimer(pool.cost_model()) for pool in [setup.prefill] * p + [setup.decode] * d]
        decode_router = make_router(config.decode_router, config.decode_router_params)
        # each pool its own autoscaler's decisions, bounds and cold start (its own weights per rank)
        pools = None if scaling is None else (scaling, replace(scaling, cold_start_s=cold_start_s(setup.decode, config)))
        return PDClusterSimulation(trace, setup, timers[:p], timers[p:], router, decode_router, config.router_staleness_s,
                                   options[:p], options[p:], pools, (config.prefill_instances, config.decode_instances),
                                   mover).run()
    finally:
        for log in logs:
            if log is not None:
                log.close()
