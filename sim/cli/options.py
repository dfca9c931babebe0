"""Command-line options shared by ``kvsim simulate``, ``execute`` and ``validate``.

Every option maps onto a :class:`sim.run.config.RunConfig` field; an option left unset keeps
the value from ``--config`` (or the default), so a TOML file and flags compose. Where vLLM
has an engine argument for a setting, the option has vLLM's name (``--gpu-memory-utilization``,
``--kv-cache-dtype``, ...; ``--request-rate`` is vLLM bench's); kvsim's earlier names still
work for one release but are left out of ``--help``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import click

from kvsim.cli.aliases import AliasedOption
from kvsim.cli.errors import user_errors
from kvsim.sim.parallel.rank_cost import ALL2ALL_BACKENDS
from kvsim.sim.perf.model_spec import QUANTIZATIONS
from kvsim.sim.run.config import CLUSTER_BACKENDS, KV_DTYPES, RunConfig, load_run_config


def _switch(name: str) -> str:
    return f"--{name}/--no-{name}"


# (flags: shown name first, then hidden old names; RunConfig field; click kwargs)
RUN_OPTIONS: list[tuple[tuple[str, ...], str, dict]] = [
    (("--trace",), "trace", {"help": "Trace file, or a bundled sample name (demo, azure_conv_10min, mooncake_500)."}),
    (("--format",), "trace_format", {"help": "Trace format. [default: detected from content]"}),
    (("--request-rate",), "request_rate",
     {"type": float, "help": "Mean arrival rate (req/s) the trace's arrivals are scaled to, as vLLM bench's. "
                             "[default: the trace's own]"}),
    (("--rate-scale", "--scale-rate"), "rate_scale", {"type": float, "help": "Or: arrivals this many times as frequent as in the trace."}),
    (("--max-requests",), "max_requests", {"type": int, "help": "Replay only the first N requests (0: all)."}),
    (("--model",), "model", {"help": "Model: a bundled name (sim/models), a kvsim TOML, a Hugging Face config.json "
                                      "or a directory holding one."}),
    (("--quantization",), "quantization",
     {"type": click.Choice(list(QUANTIZATIONS)), "help": "Weights and activations in int8 (vllm-ascend's W8A8 schemes). "
                                                        "[default: the model's dtype]"}),
    (("--expert-routing-skew",), "expert_routing_skew",
     {"type": float, "help": "MoE models: Zipf skew of the experts' popularity; 0 is uniform routing."}),
    (("--device",), "device", {"help": "Device name (sim/devices, or NAME.toml in the working directory) or TOML path."}),
    (("--tensor-parallel-size", "-tp"), "tensor_parallel_size",
     {"type": int, "help": "Devices that split each layer's heads and columns (vLLM's TP)."}),
    (("--pipeline-parallel-size", "-pp"), "pipeline_parallel_size", {"type": int, "help": "Stages the layers are split into."}),
    (("--data-parallel-size", "-dp"), "data_parallel_size",
     {"type": int, "help": "Replicas that each run their own batch (MoE layers run together across them)."}),
    ((_switch("enable-expert-parallel"),), "enable_expert_parallel",
     {"help": "Spread the routed experts over TP x DP devices instead of splitting each by TP. [default: off]"}),
    (("--all2all-backend",), "all2all_backend",
     {"type": click.Choice(list(ALL2ALL_BACKENDS)),
      "help": "vLLM's switch: how an expert-parallel group's MoE layers exchange tokens on a GPU (every token gathered "
              "and the sums scattered back, or DeepEP's all-to-all of the routed copies); Ascend devices choose their "
              "own. [default: allgather_reducescatter]"}),
    ((_switch("enable-dbo"),), "enable_dbo",
     {"help": "vLLM's dual batch overlap: steps of enough tokens run as two micro-batches, one's expert all-to-all "
              "beside the other's compute; needs a DeepEP --all2all-backend (hence --enable-expert-parallel), not on "
              "Ascend (vllm-ascend turns it off). [default: off]"}),
    (("--dbo-decode-token-threshold",), "dbo_decode_token_threshold",
     {"type": int, "help": "With --enable-dbo: the fewest tokens a batch of decodes alone is split at. [default: 32]"}),
    (("--dbo-prefill-token-threshold",), "dbo_prefill_token_threshold",
     {"type": int, "help": "With --enable-dbo: the fewest tokens a batch with a prefill is split at. [default: 512]"}),
    ((_switch("enforce-eager"),), "enforce_eager",
     {"help": "vLLM's switch: every step dispatched kernel by kernel, no captured graphs (simulate: the device's "
              "engine runs eagerly; execute / validate: the executor captures none). [default: the device's]"}),
    (("--vllm-version",), "vllm_version",
     {"help": "The vLLM release whose KV-pool sizing a GPU follows: its profile run's sampler peak (changed in 0.17) "
              "and, from 0.21, the graph capture taken off the budget. [default: the device's; none named: kvsim's own count]"}),
    ((_switch("estimate-cudagraph-memory"),), "estimate_cudagraph_memory",
     {"help": "vLLM's VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: the graph capture's memory (the device's "
              "[graph_memory]) comes off the KV budget before the pool is sized. [default: the release's, on from 0.21]"}),
    ((_switch("async-scheduling"),), "async_scheduling",
     {"help": "vLLM's switch: the next step is scheduled while the device runs this one (simulated only). "
              "[default: the device's]"}),
    (("--engine-core",), "engine_core",
     {"type": click.Choice(["v1", "v0"]), "help": "vLLM's engine generation to model: v0 adds its host time per "
                                                  "sequence per step (simulated only; pair with --scheduler vllm-v0)."}),
    ((_switch("api-server"),), "api_server",
     {"help": "Latencies as vLLM bench serve measures them: through the device's API server (its [engine] admit_s, "
              "request_s, stream_s: one process whose time the admissions and the token stream share; simulated only). "
              "[default: off]"}),
    (("--max-concurrency",), "max_concurrency",
     {"type": int, "help": "vLLM bench's clients: at most N requests in flight, the next sent when one finishes "
                           "(0: each at its arrival; simulated only)."}),
    (("--instances",), "instances", {"type": int, "help": "Copies of the instance behind a router (a cluster)."}),
    (("--router",), "router",
     {"help": "Which instance serves each request: round-robin | least-requests | least-kv | session | kv-aware | module:Class."}),
    (("--router-staleness",), "router_staleness_s",
     {"type": float, "help": "Seconds the router's view of the instances may lag (scraped metrics); 0 is live."}),
    (("--cluster-workers",), "cluster_workers",
     {"type": int, "help": "Deal the instances out to N worker processes that meet the router every --router-staleness "
                           "seconds (the router's counters then learn of ended requests at those meetings; 0: one "
                           "event loop). [default: 0]"}),
    (("--cluster-backend",), "cluster_backend",
     {"type": click.Choice(CLUSTER_BACKENDS), "help": "Where --cluster-workers run: forked processes, or Ray actors "
                                                          "(pip install 'kvsim[dist]'; RAY_ADDRESS joins a cluster). "
                                                          "[default: processes]"}),
    (("--autoscaler",), "autoscaler",
     {"help": "Scale the cluster's instances: kv-utilization | queue | module:Class (bounds and parameters: "
              "[autoscaler_params] in --config). [default: none]"}),
    (("--prefill-instances",), "prefill_instances",
     {"type": int, "help": "P/D disaggregation: instances that run prompts (behind --router); with --decode-instances "
                           "they replace --instances. [default: 0, no P/D]"}),
    (("--decode-instances",), "decode_instances",
     {"type": int, "help": "P/D disaggregation: instances that generate after the prompt's KV arrived. [default: 0]"}),
    (("--decode-router",), "decode_router", {"help": "Which decode instance takes each request (the --router names)."}),
    (("--decode-tensor-parallel-size", "-dtp"), "decode_tensor_parallel_size",
     {"type": int, "help": "P/D: the decode instances' TP (0: --tensor-parallel-size's)."}),
    (("--kv-connector",), "kv_connector",
     {"type": click.Choice(["after-prefill", "layerwise"]),
      "help": "P/D: the KV moves once the prefill ends, or layer by layer during it (Mooncake / vllm-ascend layerwise)."}),
    (("--kv-link",), "kv_link",
     {"type": click.Choice(["auto", "intra", "inter"]),
      "help": "P/D: the pools' placement: packed on nodes in order (auto), one node (intra: HCCS), a node apart (inter: RoCE)."}),
    (("--scheduler",), "scheduler",
     {"help": "fcfs | chunked | priority | sjf | static | vllm-v0 (prefill-first, as vLLM V0 and vllm-ascend's "
              "AscendScheduler) | module:Class."}),
    (("--block-manager",), "block_manager", {"help": "prefix | paged | contiguous | module:Class."}),
    ((_switch("enable-prefix-caching"),), "enable_prefix_caching",
     {"help": "vLLM's switch: on = block manager prefix, off = paged. [default: follows --block-manager]"}),
    ((_switch("enable-chunked-prefill"),), "enable_chunked_prefill",
     {"help": "vLLM's switch: whether prefills may be split across steps (the scheduler's chunked_prefill; "
              "kvsim's `chunked` scheduler is Sarathi-style decode-first and always chunks). [default: on]"}),
    (("--block-size",), "block_size",
     {"type": int, "help": "Tokens per KV block. [default: vLLM's on the device: 128 on Ascend, 16 on a GPU, 64 for an MLA "
                           "model on Hopper]"}),
    (("--kv-cache-dtype", "--kv-dtype"), "kv_dtype",
     {"type": click.Choice(["auto", *KV_DTYPES]), "help": "KV cache dtype (auto: the model's). [default: auto]"}),
    (("--gpu-memory-utilization", "--memory-utilization"), "memory_utilization",
     {"type": float, "help": "Fraction of device (NPU/GPU) memory the engine may use."}),
    (("--num-gpu-blocks-override", "--num-blocks"), "num_blocks",
     {"type": int, "help": "KV blocks, overriding the memory model (0: sized by it)."}),
    (("--max-model-len",), "max_model_len", {"type": int, "help": "Longest prompt + output accepted. [default: the model's]"}),
    (("--max-num-seqs",), "max_num_seqs",
     {"type": int, "help": "Running requests at most. [default: vLLM's on the device: 1024 on a GPU of 70 GiB or more "
                           "but an A100, else 256]"}),
    (("--max-num-batched-tokens",), "max_num_batched_tokens",
     {"type": int, "help": "Token budget per step. [default: vLLM's on the device: 8192 where --max-num-seqs is 1024, "
                           "else 2048]"}),
    (("--preemption-mode",), "preemption_mode", {"type": click.Choice(["recompute", "swap"])}),
    (("--swap-space",), "swap_space_gb", {"type": float, "help": "Host swap space in GiB."}),
    (("--kv-offload-host-gb",), "kv_offload_host_gb",
     {"type": float, "help": "Host DRAM tier under the KV pool, GiB per device: evicted prefix blocks demote to it "
                             "(LMCache / vllm-ascend KV offloading); 0: none."}),
    (("--kv-offload-ssd-gb",), "kv_offload_ssd_gb",
     {"type": float, "help": "SSD tier below the host tier, GiB per device; 0: none."}),
    (("--kv-prefetch-steps",), "kv_prefetch_steps",
     {"type": int, "help": "Steps ahead of a request's admission that its tier hits start loading (0: at admission)."}),
    (("--kv-store-gb",), "kv_store_gb",
     {"type": float, "help": "A KV store the instances share (Mooncake Store), GiB in all: computed prompt blocks are "
                             "put there and read by any instance over its network card; 0: none."}),
    (("--watermark",), "watermark", {"type": float, "help": "Fraction of blocks admission keeps free."}),
    (("--max-waiting",), "max_waiting", {"type": int, "help": "Waiting-queue cap (0: none); beyond it requests are rejected."}),
    (("--seed",), "seed", {"type": int}),
]


def _with_default(kwargs: dict, defaults: RunConfig, field_name: str) -> dict:
    """The option's help with the command's default: a default the help states stands unless the
    command's base config sets another (execute's small batch, for one)."""
    value = getattr(defaults, field_name)
    help_text = kwargs.get("help", "")
    if value is None:
        return kwargs
    if "[default:" in help_text:
        if value == getattr(RunConfig(), field_name):
            return kwargs
        help_text = help_text[: help_text.index("[default:")].rstrip()
    return {**kwargs, "help": f"{help_text} [default: {value}]".strip()}


def run_options(fn: Callable | None = None, *, defaults: RunConfig | None = None) -> Callable:
    """Decorate a click command with every RunConfig option plus ``--config``.

    ``--help`` shows ``defaults`` (the command's base config; RunConfig() unless given).
    Use as ``@run_options`` or ``@run_options(defaults=...)``.
    """
    base = defaults or RunConfig()

    def decorate(command: Callable) -> Callable:
        for flags, field_name, kwargs in reversed(RUN_OPTIONS):
            command = click.option(*flags, field_name, cls=AliasedOption, default=None,
                                   **_with_default(kwargs, base, field_name))(command)
        return click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                            help="Run configuration TOML (flags override it).")(command)

    return decorate(fn) if fn is not None else decorate


def run_config_from(options: dict, base: RunConfig | None = None) -> RunConfig:
    """Build the RunConfig from ``--config`` and the flags a user gave; pops them from ``options``."""
    config_path = options.pop("config_path", None)
    with user_errors():
        config = load_run_config(config_path, base) if config_path else (base or RunConfig())
    overrides = {field_name: options.pop(field_name, None) for _, field_name, _ in RUN_OPTIONS}
    if overrides["kv_dtype"] == "auto":
        overrides["kv_dtype"] = None
        config = replace(config, kv_dtype=None)
    return config.updated(**overrides)


def decisions_option(default: str) -> Callable:
    """``--decisions off|summary|full``: what of the decision log a run keeps (see ``sim.run.decisions``)."""
    return click.option("--decisions", type=click.Choice(["off", "summary", "full"]), default=default, show_default=True,
                        help="Decision log: off, summary (a digest to compare runs by) or full (diff-encoded, "
                             "compressed; `kvsim decisions show` expands it).")
