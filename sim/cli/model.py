"""``kvsim model``: what kvsim reads from a model (bundled, a kvsim TOML or a Hugging Face config.json)."""

from __future__ import annotations

import json

import click

from kvsim.cli.errors import UserError
from kvsim.sim.perf.model_spec import QUANTIZATIONS, ModelSpec, bundled_models, load_model
from kvsim.sim.run.outputs import model_fact_lines  # the summary's wording for the same facts


@click.group()
def model() -> None:
    """Inspect models: parameters, MoE and MLA facts, KV bytes per token."""


@model.command("info")
@click.option("--model", "model_name", required=True,
              help="A bundled name, a kvsim TOML, a Hugging Face config.json or a directory holding one.")
@click.option("--quantization", type=click.Choice(list(QUANTIZATIONS)), help="Weights and activations in int8 (W8A8).")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def info(model_name: str, quantization: str | None, as_json: bool) -> None:
    """Total and active parameters, weight bytes, KV bytes per token, and the MoE / MLA layout."""
    try:
        spec = load_model(model_name, quantization=quantization)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    data = model_info(spec)
    click.echo(json.dumps(data, indent=2) if as_json else "\n".join(format_info(data)))


@model.command("list")
def list_models() -> None:
    """The bundled models, with their architecture and parameter counts."""
    names = bundled_models()
    width = max(map(len, names)) + 2
    for name in names:
        spec = load_model(name)
        counts = spec.param_counts()
        architecture = spec.architecture or "llama-style"
        click.echo(f"{name:<{width}}{architecture:<24}{counts.total / 1e9:>9.2f}B {counts.active / 1e9:>8.2f}B active")


def model_info(spec: ModelSpec) -> dict:
    counts = spec.param_counts()
    return {
        "name": spec.name,
        "source": spec.source,
        **spec.facts(),
        "params_by_part": {k: v for k, v in vars(counts).items() if v and k != "active_routed_experts"},
        "weight_dtype": spec.weight_dtype,
        "weight_bytes": spec.weight_bytes(),
        "num_layers": spec.num_layers,
        "max_position": spec.max_position,
        "kv_dtype": spec.kv_dtype,
        "kv_bytes_per_token": spec.kv_bytes_per_token(),
    }


def format_info(data: dict) -> list[str]:
    lines = model_fact_lines(data["name"], data)
    lines += [
        f"Weights: {data['weight_bytes'] / 2**30:.2f} GiB ({data.get('quantization') or data['weight_dtype']})",
        f"KV cache: {data['kv_bytes_per_token']:,} bytes per token over {data['num_layers']} layers ({data['kv_dtype']})",
        f"Context: {data['max_position']:,} tokens",
        "Parameters by part: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in data["params_by_part"].items()),
    ]
    if data["source"]:
        lines.append(f"Source: {data['source']}")
    return lines
