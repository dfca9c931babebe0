"""``kvsim memory``: the HBM breakdown and KV block count of a model on a device."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvsim.cli.aliases import AliasedOption
from kvsim.cli.errors import UserError
from kvsim.sim.parallel.layout import ParallelLayout
from kvsim.sim.parallel.memory import budgeted_graph_bytes, buffer_bytes, plan_rank_memory, rank_graph_capture
from kvsim.sim.perf.device import engine_as_run, load_device
from kvsim.sim.perf.graph_memory import GraphCapture
from kvsim.sim.perf.memory import (
    DEFAULT_MEMORY_UTILIZATION,
    MemoryPlan,
    block_size_default,
    scheduler_defaults,
)
from kvsim.sim.perf.model_spec import QUANTIZATIONS, load_model
from kvsim.sim.run.outputs import model_fact_lines


@click.command()
@click.option("--model", "model_name", required=True,
              help="A bundled name, a kvsim TOML, a Hugging Face config.json or a directory holding one.")
@click.option("--quantization", type=click.Choice(list(QUANTIZATIONS)), help="Weights and activations in int8 (W8A8).")
@click.option("--device", "device_name", required=True, help="Bundled device, NAME.toml in the working directory, or a .toml path.")
@click.option("--kv-cache-dtype", "--kv-dtype", "kv_dtype", cls=AliasedOption, type=click.Choice(["fp16", "bf16", "int8", "fp32"]),
              help="KV cache dtype [default: the model's].")
@click.option("--block-size", type=click.IntRange(min=1),
              help="Tokens per KV block [default: vLLM's on the device: 128 on Ascend, 16 on a GPU, 64 for MLA on Hopper].")
@click.option("--max-model-len", type=click.IntRange(min=1), help="Longest sequence to serve [default: the model's max position].")
@click.option("--gpu-memory-utilization", "--memory-utilization", "memory_utilization", cls=AliasedOption,
              type=click.FloatRange(0, 1, min_open=True), default=DEFAULT_MEMORY_UTILIZATION, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1),
              help="Token budget per step [default: vLLM's on the device: 8192 on a GPU of 70 GiB or more but an A100, "
                   "else 2048].")
@click.option("--max-num-seqs", type=click.IntRange(min=1),
              help="Rows sampled in the largest step [default: vLLM's on the device: 1024 where the budget is 8192, else 256].")
@click.option("--seq-len", type=click.IntRange(min=1), help="Report how many sequences of this length fit [default: max-model-len].")
@click.option("--tensor-parallel-size", "-tp", "tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Devices that split each layer's heads and columns.")
@click.option("--pipeline-parallel-size", "-pp", "pp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Stages the layers are split into.")
@click.option("--data-parallel-size", "-dp", "dp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Replicas, each with its own KV pool.")
@click.option("--enable-expert-parallel/--no-enable-expert-parallel", "ep", default=False, show_default=True,
              help="Spread the routed experts over TP x DP devices.")
@click.option("--enforce-eager/--no-enforce-eager", default=None,
              help="vLLM's switch: no captured graphs, so no graph-capture memory. [default: the device's]")
@click.option("--vllm-version", help="The vLLM release whose KV-pool sizing a GPU follows: its profile run's sampler peak "
                                     "(changed in 0.17) and, from 0.21, the graph capture taken off the budget. "
                                     "[default: the device's; none named: kvsim's own count]")
@click.option("--estimate-cudagraph-memory/--no-estimate-cudagraph-memory", default=None,
              help="vLLM's VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: the graph capture comes off the KV budget before "
                   "the pool is sized (off: captured in the headroom). [default: the release's, on from 0.21]")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def memory(
    model_name: str,
    quantization: str | None,
    device_name: str,
    kv_dtype: str | None,
    block_size: int | None,
    max_model_len: int | None,
    memory_utilization: float,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
    seq_len: int | None,
    tp: int,
    pp: int,
    dp: int,
    ep: bool,
    enforce_eager: bool | None,
    vllm_version: str | None,
    estimate_cudagraph_memory: bool | None,
    as_json: bool,
) -> None:
    """HBM breakdown (weights, activations, reserve, KV pool) and KV block count, sized as vLLM sizes it.

    Under a parallel layout every figure is one rank's (each rank sizes its own pool, as vLLM's
    workers do). The graph capture is reported beside the budget: vLLM before v0.21 captures after
    sizing the pool, from the headroom the utilisation leaves. Exits with status 1 when the model does
    not fit or the pool cannot hold one max-length sequence.
    """
    try:
        model = load_model(model_name, quantization=quantization)
        device = engine_as_run(load_device(device_name, search_dirs=[Path.cwd()]), enforce_eager, vllm_version=vllm_version)
        default_tokens, default_seqs = scheduler_defaults(device)
        layout = ParallelLayout(tp, pp, dp, ep)
        seqs = max_num_seqs or default_seqs
        capture = rank_graph_capture(device, model, layout, seqs)
        plan = plan_rank_memory(
            model,
            device,
            layout,
            kv_dtype=kv_dtype,
            block_size=block_size or block_size_default(device, model),
            memory_utilization=memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens or default_tokens,
            max_num_seqs=seqs,
            max_model_len=max_model_len,
            graph_bytes=budgeted_graph_bytes(device, capture, estimate_cudagraph_memory),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    seq_len = seq_len or plan.max_model_len
    buffers = buffer_bytes(device, layout)
    graphs = graph_lines(plan, capture, device.name, device.captures_graphs)
    if as_json:
        parallel = {} if layout.is_single_device else {
            "layout": layout.describe(), "world_size": layout.world_size, "per_rank": True,
            "communication_buffer_bytes": buffers, "blocks_per_rank": plan.num_blocks,
            "kv_blocks_of_the_instance": plan.num_blocks * dp}
        click.echo(json.dumps({**plan.to_dict(), "seq_len": seq_len, "max_sequences": plan.max_sequences(seq_len),
                               "graph_capture": capture.to_dict() if capture else None,
                               "model_facts": model.facts(), **({"parallel": parallel} if parallel else {})}, indent=2))
    else:
        click.echo(format_plan(plan, seq_len, buffers))
        if graphs:
            click.echo("\n".join(graphs))
        if not layout.is_single_device:
            click.echo(f"{layout.describe()}: every figure above is one rank's; the instance holds "
                       f"{plan.num_blocks * dp} blocks ({dp} data-parallel pool{'s' if dp > 1 else ''})")
        if model.is_moe or model.is_mla or model.quantization:
            click.echo("\n".join(model_fact_lines(model.name, model.facts())))
    if not plan.fits:
        if not as_json:
            click.echo(f"error: {plan.problem}", err=True)
        raise SystemExit(1)


def format_plan(plan: MemoryPlan, seq_len: int, buffer_bytes: int = 0) -> str:
    kv_note = f"{plan.num_blocks} blocks x {_size(plan.bytes_per_block).strip()}"
    gathered = f"; MoE layers gather {plan.moe_tokens} (every DP member's)" if plan.moe_tokens else ""
    rows = [
        ("device memory", plan.total_bytes, ""),
        (f"budget (x{plan.memory_utilization:g})", plan.budget_bytes, ""),
        ("  weights", plan.weight_bytes, ""),
        ("  activations", plan.activation_bytes,
         f"{plan.max_num_batched_tokens} tokens, {min(plan.max_num_seqs, plan.max_num_batched_tokens)} sampled rows{gathered}"),
        ("  runtime reserve", plan.reserve_bytes - buffer_bytes, ""),
        ("  KV pool", plan.kv_pool_bytes, kv_note),
        ("  unused", plan.unused_bytes, "less than one block" if plan.fits else ""),
    ]
    if buffer_bytes:
        rows.insert(5, ("  collective buffers", buffer_bytes, "one per communication group (HCCL_BUFFSIZE; NCCL and custom all-reduce)"))
    if plan.graph_bytes:
        rows.insert(-2, ("  graph capture", plan.graph_bytes, "estimated and taken off the budget first (vLLM v0.21+)"))
    if plan.kv_scale_bytes:
        rows.insert(-1, ("  KV scales", plan.kv_scale_bytes, "static per-channel (C8), once for all blocks"))
    lines = [
        f"{plan.model} on {plan.device}: kv {plan.kv_dtype}, block {plan.block_size}, "
        f"max_model_len {plan.max_model_len}, max_num_batched_tokens {plan.max_num_batched_tokens}"
    ]
    lines += [f"{name:<22}{_size(value)}  {note}".rstrip() for name, value, note in rows]
    lines += [
        f"{'KV bytes per token':<22}{_size(plan.kv_bytes_per_token)}",
        f"{'KV capacity':<22}{plan.num_blocks:>10d} blocks = {plan.token_capacity} tokens",
        f"{f'sequences of {seq_len}':<22}{plan.max_sequences(seq_len):>10d}",
    ]
    return "\n".join(lines)


def graph_lines(plan: MemoryPlan, capture: GraphCapture | None, device: str, graph_mode: bool) -> list[str]:
    """The graph capture beside the budget, and a warning where the headroom cannot hold it."""
    if capture is None:
        return [f"{'graph capture':<22}{'unknown':>14}  no measured capture on {device}'s platform"] if graph_mode else []
    if plan.graph_bytes:  # already a row of the budget
        return []
    headroom = plan.total_bytes - plan.budget_bytes
    note = (f"{capture.piecewise_graphs} piecewise + {capture.full_graphs} full graphs of {capture.layers} layers; "
            f"outside the budget, in the {_size(headroom).strip()} headroom")
    lines = [f"{'graph capture':<22}{_size(capture.total_bytes)}  {note}"]
    if capture.total_bytes > headroom:
        lines.append(f"warning: the graph capture needs {_size(capture.total_bytes).strip()} where {1 - plan.memory_utilization:.2g} "
                     f"of the device leaves {_size(headroom).strip()}: vLLM before v0.21 runs out of memory capturing; "
                     f"lower --gpu-memory-utilization or run --enforce-eager")
    return lines


def _size(num_bytes: int) -> str:
    """Right-aligned, in the largest binary unit that keeps the value at or above 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:>10.2f} {unit}"
    return f"{num_bytes:>10d} B  "
