"""Command-line options shared by ``kvsim simulate``, ``execute`` and ``validate``.

Every option maps onto a :class:`sim.run_config.RunConfig` field; an option left unset keeps
the value from ``--config`` (or the default), so a TOML file and flags compose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import click

from kvsim.sim.run_config import RunConfig, load_run_config

# (flags, RunConfig field, click kwargs)
RUN_OPTIONS: list[tuple[tuple[str, ...], str, dict]] = [
    (("--trace",), "trace", {"help": "Trace file, or a bundled sample name (demo, azure_conv_10min, mooncake_500)."}),
    (("--format", "trace_format"), "trace_format", {"help": "Trace format (default: detected from content)."}),
    (("--rate-scale",), "rate_scale", {"type": float, "help": "Arrivals this many times as frequent (what-if traffic)."}),
    (("--max-requests",), "max_requests", {"type": int, "help": "Replay only the first N requests."}),
    (("--model",), "model", {"help": "Model name (sim/models) or TOML path."}),
    (("--device",), "device", {"help": "Device name (sim/devices, or NAME.toml in the working directory) or TOML path."}),
    (("--scheduler",), "scheduler", {"help": "fcfs | chunked | priority | sjf | static | module:Class."}),
    (("--block-manager",), "block_manager", {"help": "paged | prefix | contiguous | module:Class."}),
    (("--block-size",), "block_size", {"type": int, "help": "Tokens per KV block."}),
    (("--kv-dtype",), "kv_dtype", {"type": click.Choice(["fp16", "bf16", "int8", "fp32"]), "help": "KV cache dtype."}),
    (("--memory-utilization",), "memory_utilization", {"type": float, "help": "Fraction of device memory the engine may use."}),
    (("--num-blocks",), "num_blocks", {"type": int, "help": "KV blocks (overrides the memory model)."}),
    (("--max-model-len",), "max_model_len", {"type": int, "help": "Longest prompt + output accepted."}),
    (("--max-num-seqs",), "max_num_seqs", {"type": int, "help": "Running requests at most."}),
    (("--max-num-batched-tokens",), "max_num_batched_tokens", {"type": int, "help": "Token budget per step."}),
    (("--preemption-mode",), "preemption_mode", {"type": click.Choice(["recompute", "swap"])}),
    (("--swap-space",), "swap_space_gb", {"type": float, "help": "Host swap space in GiB."}),
    (("--watermark",), "watermark", {"type": float, "help": "Fraction of blocks admission keeps free."}),
    (("--max-waiting",), "max_waiting", {"type": int, "help": "Waiting-queue cap (0: none); beyond it requests are rejected."}),
    (("--seed",), "seed", {"type": int}),
]


def run_options(fn: Callable) -> Callable:
    """Decorate a click command with every RunConfig option plus ``--config``."""
    for flags, field_name, kwargs in reversed(RUN_OPTIONS):
        names = list(flags) if len(flags) > 1 and not flags[1].startswith("-") else [*flags, field_name]
        fn = click.option(*names, default=None, **kwargs)(fn)
    fn = click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                      help="Run configuration TOML (flags override it).")(fn)
    return fn


def run_config_from(options: dict, base: RunConfig | None = None) -> RunConfig:
    """Build the RunConfig from ``--config`` and the flags a user gave; pops them from ``options``."""
    config_path = options.pop("config_path", None)
    config = load_run_config(config_path, base) if config_path else (base or RunConfig())
    overrides = {field_name: options.pop(field_name, None) for _, field_name, _ in RUN_OPTIONS}
    return config.updated(**overrides)
