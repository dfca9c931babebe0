"""``kvsim execute``: replay a trace on a real device through the paged decoder.

The same engine and driver as ``kvsim simulate``; the real executor fills the step-timer
slot, so a real run differs from a simulated one only in where step durations come from.
Real runs skip idle gaps between arrivals.
"""

from __future__ import annotations

from pathlib import Path

import click

from kvsim.cli.errors import UserError, user_errors
from kvsim.cli.options import decisions_option, run_config_from, run_options
from kvsim.realexec.backends import BACKEND_NAMES, BackendUnavailable, KernelBackend, get_backend
from kvsim.realexec.collective_bench import measure_twice
from kvsim.realexec.executor import Executor
from kvsim.realexec.pd_pair import BACKENDS as PAIR_BACKENDS
from kvsim.realexec.pd_pair import execute_pair
from kvsim.realexec.tp_executor import TensorParallelExecutor, tensor_parallel_backend
from kvsim.sim.parallel.rank_cost import ALL2ALL_BACKENDS
from kvsim.sim.run.config import RunConfig, load_run_trace, resolve
from kvsim.sim.run.outputs import format_summary
from kvsim.sim.run.runner import run_trace
from kvsim.traces.schema import Trace

# What `kvsim execute` / `validate` run when not told otherwise: the small model on the CPU and
# the demo trace at a rate the CPU serves with room to spare. The small model, not the tiny one:
# the tiny model's decode step is some hundred small dispatches, whose speed on a shared 2-core
# VM drifted 9 % over minutes (the 768-wide, 2-layer small model's: 2 %), more than a 10 %
# per-step bar leaves room for (docs/benchmarks.md). Near capacity requests queue behind one
# another and a latency median amplifies every step's error: at 3x the trace's rate (the default
# until round 3's twelfth session) a 2 % shift of every step moved the TTFT median by 9-16 % on
# the development VM's profile, and the medians of 41 requests jump where one crosses a step
# boundary. At the trace's own rate the same shifts move the TTFT and TPOT medians by at most
# 2 % and 0.1 %, from half to 1.75x this VM's speed, for the small, small-moe and small-mla
# models (docs/validate-verdict.md). A pool of 56 blocks (896 tokens, two of the demo's longer
# requests) still forces one or two preemptions there; prefixes are still hit. The steps of two
# sequences, where this CPU's GEMM kernels cost more than a roofline says (the profile's
# row-count terms, sim/perf/device.py), are one in fifteen: few for the run-wide MAPE to show a
# model without those terms, enough for the class check (realexec/validation.py).
WORKLOAD = (
    "the bundled demo trace (41 requests of 17 Mooncake conversations: prompts of about 430 "
    "tokens sharing prefixes, outputs of about 21) at its own arrival rate (about 1 request/s), the "
    "small model, FCFS with prefix caching, a 512-token step budget and a pool of 56 blocks of 16 "
    "tokens: prefill, decode and mixed steps, prefix hits and preemptions, with the steps busy "
    "well short of saturation (at 3x the rate a 2 % shift of every step moved the TTFT median by "
    "up to 16 %: docs/validate-verdict.md)."
)
REAL_DEFAULTS = RunConfig(
    trace="demo",
    model="small",
    device="cpu",
    block_size=16,
    num_blocks=56,
    max_model_len=2048,
    max_num_batched_tokens=512,
    max_num_seqs=32,
    swap_space_gb=0.05,
)


def open_backend(name: str, enforce_eager: bool = False, tensor_parallel_size: int = 1, pair: bool = False) -> KernelBackend:
    """The backend by name (for TP > 1 rank 0's, realexec/tp_executor.py); one that cannot run here, or
    cannot run a P/D ``pair`` or a group of this size, is the user's choice to change (exit 2, its reason)."""
    if pair and name not in PAIR_BACKENDS:
        raise UserError(f"--backend {name}: the real P/D pair runs on the {', '.join(PAIR_BACKENDS)} backend (two processes "
                        "on one host); on an accelerator it is not built")
    try:
        if tensor_parallel_size > 1:
            return tensor_parallel_backend(name, tensor_parallel_size)
        return get_backend(name, enforce_eager=enforce_eager)
    except (BackendUnavailable, ValueError) as exc:
        raise UserError(str(exc)) from None


def require_executor_setup(config: RunConfig) -> None:
    """What the real executor runs: one device or a tensor-parallel group (its experts split over the TP
    ranks with --enable-expert-parallel), vLLM V1's synchronous steps. Pipeline and
    data parallelism, async scheduling, the V0 engine, the benchmark client and KV tiers are the
    simulator's alone for now."""
    if config.pipeline_parallel_size > 1 or config.data_parallel_size > 1:
        raise UserError("--pipeline-parallel-size, --data-parallel-size: the real executor runs one device or a "
                        "tensor-parallel group (--tensor-parallel-size); these layouts are simulated only "
                        "(kvsim simulate, sweep, capacity, memory)")
    if config.enable_expert_parallel and config.tensor_parallel_size < 2:
        raise UserError("--enable-expert-parallel: the real executor spreads experts over its tensor-parallel ranks; "
                        "add --tensor-parallel-size 2 or more")
    if config.tensor_parallel_size > 1:
        resolve(config)  # vLLM's layout rules (heads, columns, experts over the ranks): the user's to fix, before any process starts
    if config.enable_dbo or config.all2all_backend != ALL2ALL_BACKENDS[0]:
        raise UserError("--enable-dbo, --all2all-backend: the real executor runs each step as one batch and adds its "
                        "expert-parallel ranks' parts with an all-reduce; both are simulated only")
    if config.async_scheduling or config.engine_core != "v1":
        raise UserError("--async-scheduling, --engine-core v0: the real executor runs vLLM V1's synchronous steps; "
                        "these are simulated only")
    if config.api_server or config.max_concurrency:
        raise UserError("--api-server, --max-concurrency: the real executor replays the trace's arrivals into the engine; "
                        "the benchmark client and API server are simulated only")
    if config.instances > 1 or config.autoscaler or config.cluster_workers:
        raise UserError("--instances, --autoscaler, --cluster-workers: the real executor runs one instance or a P/D pair "
                        "(--prefill-instances 1 --decode-instances 1); clusters are simulated only (kvsim simulate)")
    if config.disaggregated:
        require_pair_setup(config)
    if config.kv_offload_host_gb or config.kv_offload_ssd_gb or config.kv_store_gb:
        raise UserError("--kv-offload-host-gb, --kv-offload-ssd-gb, --kv-store-gb: the real executor keeps KV in device "
                        "memory only; KV tiers and a shared store are simulated only (kvsim simulate)")


def require_pair_setup(config: RunConfig) -> None:
    """What the real P/D pair runs (realexec/pd_pair.py): one prefill and one decode instance, each one device,
    the KV moved after the prefill."""
    if (config.prefill_instances, config.decode_instances) != (1, 1):
        raise UserError(f"--prefill-instances {config.prefill_instances} --decode-instances {config.decode_instances}: the "
                        "real executor runs a P/D pair (1 and 1); larger pools are simulated only (kvsim simulate)")
    if config.tensor_parallel_size > 1 or config.decode_tensor_parallel_size > 1:
        raise UserError("--tensor-parallel-size, --decode-tensor-parallel-size: the real P/D pair runs each instance on one "
                        "device; P/D pools of tensor-parallel instances are simulated only")
    if config.kv_connector != "after-prefill":
        raise UserError(f"--kv-connector {config.kv_connector}: the real P/D pair moves a prompt's KV after its prefill "
                        "(after-prefill); the layerwise connector is simulated only")


def for_backend(config: RunConfig, backend: KernelBackend) -> RunConfig:
    """The config as the backend's kernels require it (the npu's FIA limits a batch's block sum)."""
    return config.updated(batch_blocks_within_pool=True) if backend.needs_batch_blocks_within_pool else config


def retimed(executor: Executor, passes: int, progress: bool) -> list[list[float]]:
    """The run's steps timed again ``passes`` times (``Executor.retime``), with a bar saying so."""
    if not passes:
        return []
    from tqdm import tqdm

    with tqdm(total=passes, desc="timing the run's steps again", unit="pass", leave=False, disable=not progress) as bar:
        return executor.retime(passes, progress=lambda: bar.update())


def execute_run(config: RunConfig, backend: KernelBackend, out_dir: Path | None, *, trace: Trace | None = None,
                weights: Path | None = None, check: bool = False, progress: bool = False, decisions: str = "summary",
                retime_passes: int = 0):
    """Run ``config`` (its ``trace``, when the caller loaded it) on a real backend; returns (SimRun, summary).
    Shared by execute and validate.

    The summary's ``measured`` block names the clock step times were taken on, how many runs of
    each step's forward pass they are the median of (``timing_repeats``) and each step's first
    run alone (``single_run_s``), and holds the run's wall-clock time beside them (``wall_s``,
    per step in ``step_wall_s``, first runs only). ``retime_passes`` times the run's steps again
    that many times once it is over (``Executor.retime``), into ``retimed_s``: one list a pass.
    A tensor-parallel run also times its group's collectives at a step's sizes once it is over,
    twice (``collectives``: a fit set and a check set, realexec/collective_bench.py).
    """
    config = for_backend(config, backend)
    resolved = resolve(config)
    trace = load_run_trace(config) if trace is None else trace
    engine_config = resolved.engine_config
    sizing = dict(num_blocks=engine_config.num_blocks, block_size=engine_config.block_size,
                  num_host_blocks=engine_config.num_host_blocks, seed=config.seed, weights_path=weights,
                  kv_dtype=resolved.memory.kv_dtype, check=check, keep_plans=retime_passes > 0)
    tp = config.tensor_parallel_size
    executor = (TensorParallelExecutor(resolved.model, backend, tp, expert_parallel=config.enable_expert_parallel, **sizing)
                if tp > 1 else Executor(resolved.model, backend, **sizing))

    def measured(run) -> dict:
        memory = [m for m in run.steps.column("memory_bytes") if m is not None]
        return {
            "backend": backend.name,
            "measured": {
                "clock": backend.clock,
                "timing_repeats": executor.timing_repeats,
                "single_run_s": executor.single_run_s,
                "wall_s": sum(executor.wall_s),
                "step_wall_s": executor.wall_s,
                "device_s": sum(d for d in run.steps.column("device_s") if d is not None),
                "host_s": sum(h for h in run.steps.column("host_s") if h is not None),
                "peak_memory_bytes": max(memory, default=None),
                "kv_pool_bytes": executor.kv_pool_bytes,
                "retimed_s": retimed(executor, retime_passes, progress),
                **({"collectives": measure_twice(executor.time_collectives, resolved.model, tp)} if tp > 1 else {}),
            },
        }

    try:
        return run_trace(resolved, trace, executor, out_dir, check=check, progress=progress,
                         label="execute", summary_extras=measured, decisions=decisions)
    finally:
        if isinstance(executor, TensorParallelExecutor):
            executor.close()


@click.command()
@run_options(defaults=REAL_DEFAULTS)
@click.option("--backend", type=click.Choice(BACKEND_NAMES), default="cpu", show_default=True)
@click.option("--weights", type=click.Path(exists=True, path_type=Path),
              help="safetensors file or directory (default: seeded random weights).")
@click.option("--check", is_flag=True, help="Verify every plan and the engine's invariants (slower; not for timing).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path), help="Run directory.")
@click.option("--quiet", is_flag=True)
@decisions_option("summary")
def execute(backend: str, weights: Path | None, check: bool, out_dir: Path, quiet: bool,
            decisions: str, **options) -> None:
    """Run a trace on a real device; write the same files as simulate, with measured times."""
    with user_errors():  # what the user chose: config, trace, backend (exit 2)
        config = run_config_from(options, base=REAL_DEFAULTS)
        require_executor_setup(config)
        trace = load_run_trace(config)
        if config.disaggregated and weights is not None:
            raise UserError("--weights: the real P/D pair runs seeded random weights")
        kernels = open_backend(backend, bool(config.enforce_eager), config.tensor_parallel_size, config.disaggregated)
    try:
        if config.disaggregated:
            _, summary = execute_pair(config, kernels, out_dir, trace, check=check, decisions=decisions)
        else:
            _, summary = execute_run(config, kernels, out_dir, trace=trace, weights=weights, check=check, progress=not quiet,
                                     decisions=decisions)
    except (ValueError, KeyError, RuntimeError) as exc:  # the run itself failed on the device (exit 1)
        raise click.ClickException(str(exc).strip("'\"")) from None
    if not quiet:
        click.echo(format_summary(summary, title=f"kvsim execute ({backend})"))
    click.echo(f"wrote {out_dir}")
