"""``kvsim device``: what kvsim reads from a device file (bundled, beside the run, or a path), bases merged."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from kvsim.cli.errors import UserError
from kvsim.sim.perf.device import DeviceProfile, bundled_devices, load_device
from kvsim.sim.perf.memory import block_size_default, scheduler_defaults
from kvsim.sim.perf.model_spec import load_model

GiB = 2**30
DENSE_PROBE_MODEL = "qwen3-8b"  # any dense model: the block-size default differs only for MLA models on Hopper
MLA_PROBE_MODEL = "small-mla"


@click.group()
def device() -> None:
    """Inspect devices: memory, rates, links, engine mode, and the vLLM defaults they imply."""


@device.command("list")
def list_devices() -> None:
    """The bundled devices, with their platform, memory, bandwidth and bf16 peak."""
    names = bundled_devices()
    width = max(map(len, names)) + 2
    for name in names:
        d = load_device(name)
        click.echo(f"{name:<{width}}{kind(d):<16}{d.hbm_bytes / GiB:>7.1f} GiB {d.hbm_bandwidth / 1e12:>6.2f} TB/s "
                   f"{d.matrix_flops['bf16'] / 1e12:>8.1f} TFLOP/s bf16")


@device.command("info")
@click.option("--device", "device_name", required=True,
              help="Device name (sim/devices, or NAME.toml in the working directory) or TOML path.")
@click.option("--json", "as_json", is_flag=True, help="Print every field as JSON.")
def info(device_name: str, as_json: bool) -> None:
    """Every figure kvsim prices the device with (after its ``base``, if any), and vLLM's defaults on it."""
    try:
        dev = load_device(device_name, search_dirs=[Path.cwd()])
    except ValueError as exc:
        raise UserError(str(exc)) from None
    data = device_info(dev)
    click.echo(json.dumps(data, indent=2) if as_json else "\n".join(format_info(dev, data)))


def device_info(dev: DeviceProfile) -> dict:
    tokens, seqs = scheduler_defaults(dev)
    defaults = {"block_size": block_size_default(dev, load_model(DENSE_PROBE_MODEL)),
                "block_size_mla": block_size_default(dev, load_model(MLA_PROBE_MODEL)),
                "max_num_batched_tokens": tokens, "max_num_seqs": seqs}
    return {**asdict(dev), "vllm_defaults": defaults}


def kind(dev: DeviceProfile) -> str:
    return f"{dev.platform} {dev.generation}".strip()


def format_info(dev: DeviceProfile, data: dict) -> list[str]:
    peaks = ", ".join(f"{dt} {rate / 1e12:.1f}" for dt, rate in dev.matrix_flops.items())
    lines = [
        f"{dev.name} ({kind(dev)})",
        f"Memory: {dev.hbm_bytes / GiB:.2f} GiB at {dev.hbm_bandwidth / 1e12:.2f} TB/s; the runtime holds "
        f"{dev.runtime_reserve_bytes / GiB:.2f} GiB outside the allocator",
        f"Matrix peaks (TFLOP/s): {peaks}; vector {dev.vector_flops / 1e12:.1f}",
        f"Links (one way): host {dev.host_link_bandwidth / 1e9:.0f} GB/s, device to device "
        f"{dev.interconnect_bandwidth / 1e9:.0f} GB/s",
    ]
    if dev.topology is not None:
        t = dev.topology
        lines.append(f"Topology: {t.devices_per_node} devices a node on a {t.intra_fabric} fabric at "
                     f"{t.intra_bandwidth / 1e9:.0f} GB/s, {t.inter_bandwidth / 1e9:.0f} GB/s between nodes")
    if dev.engine is not None:
        e = dev.engine
        graphs = f", {len(e.capture_sizes)} capture sizes up to {max(e.capture_sizes)}" if e.capture_sizes else ""
        lines.append(f"Engine: {e.mode} mode{graphs}; {'async' if e.async_scheduling else 'synchronous'} scheduling")
    if dev.graph_memory is not None:
        g = dev.graph_memory
        lines.append(f"Graph capture: {g.layer_bytes / 2**10:.0f} KiB a layer and graph (+{g.moe_layer_bytes / 2**10:.0f} "
                     f"an MoE layer), {g.split_accumulators:g} split-KV partials a decode row, {g.pool_bytes / 2**20:.0f} MiB once")
    d = data["vllm_defaults"]
    mla = "" if d["block_size_mla"] == d["block_size"] else f" ({d['block_size_mla']} for an MLA model)"
    lines.append(f"vLLM's defaults here: block size {d['block_size']}{mla}, max_num_batched_tokens "
                 f"{d['max_num_batched_tokens']}, max_num_seqs {d['max_num_seqs']}")
    gemm = dev.operators["gemm"]
    lines.append(f"GEMM share of peak: compute {gemm.compute_efficiency}, memory {gemm.memory_efficiency}")
    if dev.source:
        lines.append(f"Source: {dev.source}")
    return lines
