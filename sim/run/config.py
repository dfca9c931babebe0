"""A run's full configuration: trace, model, device, pool sizing and policies.

A run is fixed by this and its seed. It comes from a TOML file (``--config run.toml``, the
same field names, policy parameters in ``[scheduler_params]`` / ``[block_manager_params]``)
with command-line options on top, and it is written back, resolved, into ``summary.json``.

Where vLLM has a name for a setting, a TOML file may use it (``gpu_memory_utilization``,
``kv_cache_dtype``, ``num_gpu_blocks_override``, ``swap_space``): :data:`VLLM_KEYS` maps them
onto the fields. ``enable_prefix_caching`` and ``enable_chunked_prefill`` are fields of their
own, applied by :meth:`RunConfig.normalized`.
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from kvsim import traces
from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.policies.hashing import check_block_size_compatible
from kvsim.policies.kv_store import StoreSpec
from kvsim.policies.kv_tiers import TierConfig, TierSpec
from kvsim.sim.parallel.layout import ParallelLayout
from kvsim.sim.parallel.memory import budgeted_graph_bytes, buffer_bytes, plan_rank_memory, rank_graph_capture
from kvsim.sim.parallel.rank_cost import ALL2ALL_BACKENDS, DualBatchOverlap, ParallelCostModel
from kvsim.sim.perf.cost_model import CostModel
from kvsim.sim.perf.device import ENGINE_CORES, DeviceProfile, engine_as_run, load_device
from kvsim.sim.perf.expert_routing import ExpertRouting
from kvsim.sim.perf.memory import MemoryPlan, block_size_default, scheduler_defaults
from kvsim.sim.perf.model_spec import QUANTIZATIONS, ModelSpec, load_model
from kvsim.sim.toml_io import load_toml
from kvsim.traces.schema import Trace

GIB = 2**30


@dataclass
class RunConfig:
    trace: str = "demo"  # a path, or the name of a bundled sample
    trace_format: str | None = None
    rate_scale: float = 1.0  # what-if: arrivals this many times as frequent (2.0 = twice the traffic)
    request_rate: float | None = None  # what-if: scale the trace to this mean rate (req/s, as vLLM bench's)
    max_requests: int = 0  # replay only the first N requests; 0 = all
    model: str = "llama-2-7b"
    quantization: str | None = None  # vLLM's --quantization: w8a8 or w8a8_dynamic (vllm-ascend); None: the model's weights
    expert_routing_skew: float = 0.0  # MoE models: Zipf skew of the experts' popularity (0: uniform routing)
    device: str = "ascend-910b3"
    # vLLM's parallel flags (sim/parallel/layout.py): one instance over TP x PP x DP devices
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # vLLM's dual batch overlap (sim/parallel/rank_cost.py DualBatchOverlap): steps of at least these many tokens
    # (a batch of decodes alone / one with a prefill) run as two micro-batches whose expert exchange overlaps compute
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    # vLLM's --all2all-backend: how an EP group's MoE layers exchange tokens on a GPU (sim/parallel/rank_cost.py)
    all2all_backend: str = ALL2ALL_BACKENDS[0]
    # How the serving engine runs (sim/perf/device.py engine_as_run): vLLM's --enforce-eager and
    # --async-scheduling (None: the device's [engine]), and the engine generation ("v0": vLLM's V0
    # LLMEngine, whose host time per sequence the device's [engine] v0_seq_s prices)
    enforce_eager: bool | None = None
    async_scheduling: bool | None = None
    engine_core: str = "v1"
    # The vLLM release whose KV-pool sizing rules apply on a GPU (sim/perf/vllm_release.py; "": the device
    # engine's), and its VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: the graph capture's memory off the KV budget
    # before the pool is sized (sim/parallel/memory.py budgeted_graph_bytes; None: the release's, on from 0.21)
    vllm_version: str = ""
    estimate_cudagraph_memory: bool | None = None
    # The benchmark client in front (sim/run/clients.py, as vLLM bench serve runs): latencies through the
    # device's API server (its [engine] admit_s, request_s, stream_s), and at most max_concurrency requests
    # in flight (0: each sent at its arrival)
    api_server: bool = False
    max_concurrency: int = 0
    # A cluster (sim/cluster): this many copies of the instance above behind a router that reads
    # the instances' state as scraped at most router_staleness_s ago
    instances: int = 1
    router: str = "round-robin"
    router_params: dict = field(default_factory=dict)
    router_staleness_s: float = 0.0
    # 0: every instance in one event loop; N: the instances dealt out to N worker processes that meet
    # the router every router_staleness_s (sim/cluster/partitioned.py)
    cluster_workers: int = 0
    cluster_backend: str = "processes"  # processes (forked) | ray (actors, kvsim[dist])
    autoscaler: str = ""  # "": a fixed number of instances; else a policy (sim/cluster/autoscaler.py)
    autoscaler_params: dict = field(default_factory=dict)  # min/max_instances, interval_s, load_bandwidth, start_s, the policy's
    # Prefill/decode disaggregation (sim/cluster/disagg.py): both > 0 replace ``instances`` with a
    # prefill pool behind ``router`` and a decode pool behind ``decode_router``, the prompt's KV
    # moving between them (sim/cluster/kv_transfer.py) over the device's [topology]
    prefill_instances: int = 0
    decode_instances: int = 0
    decode_router: str = "least-requests"
    decode_router_params: dict = field(default_factory=dict)
    decode_tensor_parallel_size: int = 0  # 0: the prefill pool's tensor_parallel_size
    kv_connector: str = "after-prefill"  # after-prefill | layerwise
    kv_link: str = "auto"  # auto (pools packed on nodes in order) | intra (one node) | inter (a node apart)
    scheduler: str = "fcfs"
    scheduler_params: dict = field(default_factory=dict)
    block_manager: str = "prefix"
    block_manager_params: dict = field(default_factory=dict)
    block_size: int | None = None  # None: vLLM's on the device (block_size_default): 128 on Ascend, 16 on a GPU
    kv_dtype: str | None = None  # None: the model's
    memory_utilization: float = 0.9
    num_blocks: int = 0  # 0: sized by the memory model
    max_model_len: int | None = None  # None: the model's maximum
    max_num_seqs: int | None = None  # None: what `vllm serve` takes on the device (scheduler_defaults)
    max_num_batched_tokens: int | None = None  # None: as max_num_seqs
    preemption_mode: str = "recompute"
    swap_space_gb: float = 4.0  # vLLM's default swap space
    # KV tiers below HBM (policies/kv_tiers.py), GiB per device as swap_space: evicted prefix blocks
    # demote to host DRAM, then SSD; hits promote, prefetched this many steps ahead. 0 GiB: no tier.
    kv_offload_host_gb: float = 0.0
    kv_offload_ssd_gb: float = 0.0
    kv_prefetch_steps: int = 1
    # A KV store the instances share (policies/kv_store.py), GiB in all, as Mooncake Store's segments
    # add up: prompt blocks are put there, any instance reads them over its network card. 0: none.
    kv_store_gb: float = 0.0
    watermark: float = 0.0
    max_waiting: int = 0
    long_prefill_token_threshold: int = 0
    batch_blocks_within_pool: bool = False  # Ascend FIA's limit (policies.config); execute/validate set it for npu
    seed: int = 0
    enable_prefix_caching: bool | None = None  # vLLM's switch: True = block manager prefix, False = paged
    enable_chunked_prefill: bool | None = None  # vLLM's switch: the scheduler's chunked_prefill parameter

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode pools instead of ``instances`` copies."""
        return self.prefill_instances > 0 or self.decode_instances > 0

    @property
    def is_cluster(self) -> bool:
        """Instances behind a router (sim/cluster/runner.py) rather than one engine."""
        return self.instances > 1 or bool(self.autoscaler) or self.disaggregated

    def updated(self, **overrides) -> RunConfig:
        """A copy with every override that is not None applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)

    def normalized(self) -> RunConfig:
        """The config with vLLM's two switches applied to the block manager and scheduler.

        ``enable_prefix_caching``: True needs the ``prefix`` manager, False turns ``prefix``
        into ``paged`` (``contiguous`` and plugins are left alone). ``enable_chunked_prefill``
        sets the scheduler's ``chunked_prefill`` parameter (vLLM V1 chunks prefills by
        default; so does kvsim's fcfs); the Sarathi-style ``chunked`` scheduler always
        chunks, so it refuses False.
        """
        out = replace(self, kv_dtype=None) if self.kv_dtype == "auto" else self
        if self.enable_prefix_caching is True and self.block_manager in ("paged", "contiguous"):
            raise ValueError(f"enable_prefix_caching = true needs block_manager 'prefix', not {self.block_manager!r}")
        if self.enable_prefix_caching is False and self.block_manager == "prefix":
            out = replace(out, block_manager="paged")
        if self.enable_chunked_prefill is not None:
            if self.scheduler in ("chunked", "static") and not self.enable_chunked_prefill:
                raise ValueError(f"scheduler {self.scheduler!r} always chunks prefills; "
                                 "enable_chunked_prefill = false needs fcfs, priority or sjf")
            if self.scheduler not in ("chunked", "static"):
                out = replace(out, scheduler_params={**self.scheduler_params, "chunked_prefill": self.enable_chunked_prefill})
        return out

    def validate(self) -> RunConfig:
        """Check value ranges, naming the key (vLLM's name where it has one); returns self."""
        problems = [(name, rule) for name, rule, ok in _range_rules(self) if not ok]
        if problems:
            name, rule = problems[0]
            raise ValueError(f"{_KEY_NAMES.get(name, name)} = {getattr(self, name)!r}: {rule}")
        return self


KV_DTYPES = ("fp16", "bf16", "int8", "fp32")
CLUSTER_BACKENDS = ("processes", "ray")  # where cluster_workers run (sim/cluster/partitioned.py)

# vLLM engine-argument names (as TOML keys) -> RunConfig fields
VLLM_KEYS = {
    "gpu_memory_utilization": "memory_utilization",
    "kv_cache_dtype": "kv_dtype",
    "num_gpu_blocks_override": "num_blocks",
    "swap_space": "swap_space_gb",
}
_KEY_NAMES = {v: k for k, v in VLLM_KEYS.items()}


def _finite_positive(x) -> bool:
    return math.isfinite(x) and x > 0


def _range_rules(c: RunConfig) -> list[tuple[str, str, bool]]:
    return [
        ("rate_scale", "must be a finite number > 0", _finite_positive(c.rate_scale)),
        ("request_rate", "must be a finite number > 0 (requests per second)", c.request_rate is None or _finite_positive(c.request_rate)),
        ("max_requests", "must be >= 0 (0: all)", c.max_requests >= 0),
        ("block_size", "must be >= 1", c.block_size is None or c.block_size >= 1),
        ("kv_dtype", f"must be auto or one of {', '.join(KV_DTYPES)}", c.kv_dtype in (None, "auto", *KV_DTYPES)),
        ("memory_utilization", "must be in (0, 1]", 0 < c.memory_utilization <= 1),
        ("num_blocks", "must be >= 0 (0: sized by the memory model)", c.num_blocks >= 0),
        ("max_model_len", "must be >= 1", c.max_model_len is None or c.max_model_len >= 1),
        ("max_num_seqs", "must be >= 1", c.max_num_seqs is None or c.max_num_seqs >= 1),
        ("max_num_batched_tokens", "must be >= 1", c.max_num_batched_tokens is None or c.max_num_batched_tokens >= 1),
        ("preemption_mode", "must be recompute or swap", c.preemption_mode in ("recompute", "swap")),
        ("swap_space_gb", "must be a finite number >= 0 (GiB)", math.isfinite(c.swap_space_gb) and c.swap_space_gb >= 0),
        ("kv_offload_host_gb", "must be a finite number >= 0 (GiB; 0: no host tier)",
         math.isfinite(c.kv_offload_host_gb) and c.kv_offload_host_gb >= 0),
        ("kv_offload_ssd_gb", "must be a finite number >= 0 (GiB; 0: no SSD tier)",
         math.isfinite(c.kv_offload_ssd_gb) and c.kv_offload_ssd_gb >= 0),
        ("kv_prefetch_steps", "must be >= 0 (0: a promotion starts at the step that needs it)", c.kv_prefetch_steps >= 0),
        ("kv_store_gb", "must be a finite number >= 0 (GiB; 0: no shared store)",
         math.isfinite(c.kv_store_gb) and c.kv_store_gb >= 0),
        ("watermark", "must be in [0, 1)", 0 <= c.watermark < 1),
        ("max_waiting", "must be >= 0 (0: no cap)", c.max_waiting >= 0),
        ("tensor_parallel_size", "must be >= 1", c.tensor_parallel_size >= 1),
        ("pipeline_parallel_size", "must be >= 1", c.pipeline_parallel_size >= 1),
        ("data_parallel_size", "must be >= 1", c.data_parallel_size >= 1),
        ("dbo_decode_token_threshold", "must be >= 1", c.dbo_decode_token_threshold >= 1),
        ("dbo_prefill_token_threshold", "must be >= 1", c.dbo_prefill_token_threshold >= 1),
        ("all2all_backend", f"must be one of {', '.join(ALL2ALL_BACKENDS)}", c.all2all_backend in ALL2ALL_BACKENDS),
        ("all2all_backend", "needs enable_expert_parallel: it moves the experts' tokens",
         c.all2all_backend == ALL2ALL_BACKENDS[0] or c.enable_expert_parallel),
        ("enable_dbo", "needs all2all_backend deepep_high_throughput or deepep_low_latency, as vLLM asserts "
                       "(vllm/config/vllm.py)", not c.enable_dbo or c.all2all_backend.startswith("deepep")),
        ("instances", "must be >= 1", c.instances >= 1),
        ("max_concurrency", "must be >= 0 (0: no limit)", c.max_concurrency >= 0),
        ("prefill_instances", "must be >= 0 (0: no P/D pools)", c.prefill_instances >= 0),
        ("decode_instances", "must be >= 0 (0: no P/D pools)", c.decode_instances >= 0),
        ("decode_instances", "must be >= 1: a prefill pool needs a decode pool", c.prefill_instances <= 0 or c.decode_instances >= 1),
        ("prefill_instances", "must be >= 1: a decode pool needs a prefill pool", c.decode_instances <= 0 or c.prefill_instances >= 1),
        ("decode_tensor_parallel_size", "must be >= 0 (0: tensor_parallel_size)", c.decode_tensor_parallel_size >= 0),
        ("kv_connector", "must be after-prefill or layerwise", c.kv_connector in ("after-prefill", "layerwise")),
        ("kv_link", "must be auto, intra or inter", c.kv_link in ("auto", "intra", "inter")),
        ("router_staleness_s", "must be a finite number >= 0 (seconds)", math.isfinite(c.router_staleness_s) and c.router_staleness_s >= 0),
        ("cluster_workers", "must be >= 0 (0: one event loop)", c.cluster_workers >= 0),
        ("cluster_backend", f"must be one of {', '.join(CLUSTER_BACKENDS)}", c.cluster_backend in CLUSTER_BACKENDS),
        ("cluster_workers", f"must be at most instances ({c.instances})", c.cluster_workers <= c.instances),
        ("router_staleness_s", "must be > 0 with cluster_workers: the workers meet the router at that interval",
         c.cluster_workers == 0 or c.router_staleness_s > 0),
        ("cluster_workers", "partitions a fixed set of instances: not with P/D pools or an autoscaler",
         c.cluster_workers == 0 or not (c.prefill_instances or c.decode_instances or c.autoscaler)),
        ("cluster_workers", "runs instances apart between the router's meetings: not with a shared KV store "
         "(kv_store_gb), which they read and write at every step", c.cluster_workers == 0 or not c.kv_store_gb),
        ("engine_core", f"must be one of {', '.join(ENGINE_CORES)}", c.engine_core in ENGINE_CORES),
        ("quantization", f"must be one of {', '.join(QUANTIZATIONS)}", c.quantization in (None, *QUANTIZATIONS)),
        ("expert_routing_skew", "must be a finite number >= 0 (0: uniform)",
         math.isfinite(c.expert_routing_skew) and c.expert_routing_skew >= 0),
    ]


def check_types(data: dict, where: str) -> None:
    """Every value has its field's type (an int where a float goes is fine; a bool is no int)."""
    hints = typing.get_type_hints(RunConfig)
    for key, value in data.items():
        expected = hints[VLLM_KEYS.get(key, key)]
        if not _has_type(value, expected):
            raise ValueError(f"{where}: {key} = {value!r}: expected {_type_name(expected)}")


def _has_type(value, expected) -> bool:
    args = typing.get_args(expected)
    if args:  # X | None
        return any(_has_type(value, a) for a in args)
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _type_name(expected) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}
    return " or ".join(names[a] for a in (typing.get_args(expected) or (expected,)) if a is not type(None))


def config_fields(data: dict, where: str) -> dict:
    """TOML keys checked (known, typed) and mapped onto RunConfig field names."""
    allowed = {f.name for f in fields(RunConfig)} | set(VLLM_KEYS)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    check_types(data, where)
    out: dict = {}
    for key, value in data.items():
        name = VLLM_KEYS.get(key, key)
        if name in out:
            raise ValueError(f"{where}: {_KEY_NAMES[name]} and {name} both given; keep {_KEY_NAMES[name]} (vLLM's name)")
        out[name] = value
    return out


def load_run_config(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """``base`` (default: RunConfig()) with the TOML file's fields on top.

    A ``[validation]`` table (thresholds for ``kvsim validate``) is read separately.
    """
    data = load_toml(path)
    data.pop("validation", None)
    return replace(base or RunConfig(), **config_fields(data, str(path)))


@dataclass
class ResolvedRun:
    """A RunConfig with its model, device and memory plan looked up and the engine config built."""

    config: RunConfig
    model: ModelSpec
    device: DeviceProfile
    memory: MemoryPlan
    engine_config: EngineConfig

    layout: ParallelLayout = field(default_factory=ParallelLayout)

    def new_engine(self) -> EngineCore:
        return EngineCore(self.engine_config)

    def cost_model(self) -> CostModel | ParallelCostModel:
        """The cost model for this run's model, device, block size and KV dtype (one rank plus its
        collectives under a parallel layout: sim/parallel/rank_cost.py)."""
        if self.layout.is_single_device:
            return CostModel(self.model, self.device, self.config.block_size, self.memory.kv_dtype, routing=self.routing())
        c = self.config
        overlap = DualBatchOverlap(c.dbo_decode_token_threshold, c.dbo_prefill_token_threshold) if c.enable_dbo else None
        return ParallelCostModel(self.model, self.device, self.layout, c.block_size, self.memory.kv_dtype,
                                 routing=self.routing(), max_num_batched_tokens=c.max_num_batched_tokens, overlap=overlap,
                                 all2all_backend=c.all2all_backend)

    def routing(self) -> ExpertRouting | None:
        """The routing assumption of an MoE model (None for a dense one)."""
        m = self.model
        return ExpertRouting(m.num_experts, m.num_experts_per_tok, self.config.expert_routing_skew) if m.is_moe else None

    def to_dict(self) -> dict:
        resolved = {
            "kv_dtype": self.memory.kv_dtype,
            "max_model_len": self.engine_config.max_model_len,
            "num_blocks": self.engine_config.num_blocks,
            "num_host_blocks": self.engine_config.num_host_blocks,
            "bytes_per_block": self.memory.bytes_per_block,
            "kv_pool_bytes": self.engine_config.num_blocks * self.memory.bytes_per_block,
        }
        facts = self.model.facts()
        if set(facts) - {"architecture", "total_params", "active_params"}:  # MoE, MLA or W8A8: say what was used
            if "moe" in facts:
                facts["moe"]["routing"] = self.routing().describe()
            resolved["model"] = facts
        engine = self.device.engine
        if engine is not None and engine.capped_from:  # the sizes kept, as vLLM / vllm-ascend log them
            resolved["graph_capture_sizes"] = list(engine.capture_sizes)
        tiers = self.engine_config.kv_tiers
        if tiers is not None:
            resolved["kv_tier_blocks"] = {"host": tiers.host.capacity_blocks, "ssd": tiers.ssd.capacity_blocks,
                                          **({"store": tiers.store.capacity_blocks} if tiers.store else {})}
        if not self.layout.is_single_device:
            resolved["parallel"] = {"layout": self.layout.describe(), "world_size": self.layout.world_size,
                                    "expert_parallel_size": self.layout.expert_parallel_size,
                                    "blocks_per_rank": self.memory.num_blocks,
                                    "communication_buffer_bytes": buffer_bytes(self.device, self.layout)}
        return {**self.config.to_dict(), "resolved": resolved}


def with_device_defaults(config: RunConfig, device: DeviceProfile, model: ModelSpec) -> RunConfig:
    """``config`` with the block size and scheduler budget it leaves unset filled in as vLLM would on ``device``."""
    tokens, seqs = scheduler_defaults(device)
    return replace(config, max_num_batched_tokens=config.max_num_batched_tokens or tokens,
                   max_num_seqs=config.max_num_seqs or seqs,
                   block_size=config.block_size or block_size_default(device, model))


def run_block_size(config: RunConfig, search_dirs: tuple[str | Path, ...] = (".",)) -> int:
    """The block size a run will take, before it is resolved (its trace's prefix hashes are checked against it)."""
    if config.block_size is not None:
        return config.block_size
    return block_size_default(load_device(config.device, search_dirs=search_dirs),
                              load_model(config.model, quantization=config.quantization))


def resolve(config: RunConfig, search_dirs: tuple[str | Path, ...] = (".",)) -> ResolvedRun:
    """Look up the model and device and size the KV pool exactly as an engine would."""
    config = config.validate().normalized()
    model = load_model(config.model, quantization=config.quantization)
    device = engine_as_run(load_device(config.device, search_dirs=search_dirs), config.enforce_eager,
                           config.async_scheduling, config.engine_core, config.vllm_version)
    config = with_device_defaults(config, device, model)
    if config.enable_dbo and device.platform == "ascend":
        raise ValueError(f"enable_dbo: vllm-ascend turns dual batch overlap off on Ascend devices "
                         f"(vllm_ascend/platform.py resets it to False); device {device.name} runs without it")
    if config.all2all_backend != ALL2ALL_BACKENDS[0] and device.platform == "ascend":
        raise ValueError(f"all2all_backend = {config.all2all_backend!r}: on Ascend devices vllm-ascend chooses the MoE "
                         f"exchange itself (MC2, all-gather or all-to-all); device {device.name} takes no all2all backend")
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size, config.data_parallel_size,
                            config.enable_expert_parallel)
    if device.engine is not None:  # graphs up to 2 x max_num_seqs; ACL graph's fewer for deeper models (engine_overhead.py)
        device = replace(device, engine=device.engine.for_run(config.max_num_seqs, model.num_layers,
                                                              layout.tensor_parallel_size, layout.data_parallel_size))
    memory = plan_rank_memory(  # one rank's pool; a DP group's engine holds every member's (module docstring of rank_cost)
        model,
        device,
        layout,
        all2all_backend=config.all2all_backend,
        kv_dtype=config.kv_dtype,
        block_size=config.block_size,
        memory_utilization=config.memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        graph_bytes=budgeted_graph_bytes(device, rank_graph_capture(device, model, layout, config.max_num_seqs),
                                         config.estimate_cudagraph_memory),
    )
    dp = layout.data_parallel_size
    num_blocks = config.num_blocks or memory.require_fit().num_blocks * dp
    engine_config = EngineConfig(
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_host_blocks=int(config.swap_space_gb * GIB) // memory.bytes_per_block * dp,
        max_model_len=memory.max_model_len,
        max_num_seqs=config.max_num_seqs * dp,
        max_num_batched_tokens=config.max_num_batched_tokens * dp,
        scheduler=config.scheduler,
        scheduler_params=dict(config.scheduler_params),
        block_manager=config.block_manager,
        block_manager_params=dict(config.block_manager_params),
        preemption_mode=config.preemption_mode,
        watermark=config.watermark,
        max_waiting=config.max_waiting,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        batch_blocks_within_pool=config.batch_blocks_within_pool,
        kv_tiers=kv_tiers(config, device, memory.bytes_per_block, layout),
    )
    resolved = ResolvedRun(config, model, device, memory, engine_config, layout)
    _check_policies(resolved)
    return resolved


def kv_tiers(config: RunConfig, device: DeviceProfile, bytes_per_block: int, layout: ParallelLayout) -> TierConfig | None:
    """The tiers under the pool from the run's sizes and the device's figures; None with every size 0.

    Host and SSD sizes are per device as ``swap_space``; each must fit what the device file states
    (host DRAM per device) and the device must state the figures its tier reads. An SSD block
    reaches HBM through host memory: the slower of the SSD and the host link, both latencies. The
    shared store's size is the whole store's; a read comes over the device's network card
    (``[topology]`` inter_bandwidth at its achieved fraction).
    """
    host_gb, ssd_gb, store_gb = config.kv_offload_host_gb, config.kv_offload_ssd_gb, config.kv_store_gb
    if not host_gb and not ssd_gb and not store_gb:
        return None
    if config.normalized().block_manager != "prefix":
        raise ValueError(f"{'kv_store_gb' if store_gb else 'kv_offload_host_gb / kv_offload_ssd_gb'}: KV tiers hold "
                         f"cached prefixes and need block_manager 'prefix', not {config.normalized().block_manager!r}")
    if host_gb and not device.host_memory_bytes:
        raise ValueError(f"kv_offload_host_gb = {host_gb!r}: device {device.name} states no host_memory_bytes")
    if host_gb * GIB > device.host_memory_bytes:
        raise ValueError(f"kv_offload_host_gb = {host_gb!r}: larger than the host memory of device {device.name} "
                         f"({device.host_memory_bytes / GIB:g} GiB per device)")
    if ssd_gb and not device.ssd_bandwidth:
        raise ValueError(f"kv_offload_ssd_gb = {ssd_gb!r}: device {device.name} states no ssd_bandwidth")
    dp = layout.data_parallel_size

    def blocks(gb: float) -> int:
        return int(gb * GIB) // bytes_per_block * dp

    host = TierSpec(blocks(host_gb), device.host_link_bandwidth, device.host_link_latency_s)
    ssd = TierSpec(blocks(ssd_gb), min(device.ssd_bandwidth, device.host_link_bandwidth),
                   device.ssd_latency_s + device.host_link_latency_s)
    return TierConfig(host, ssd, bytes_per_block, config.kv_prefetch_steps,
                      store=kv_store(store_gb, device, bytes_per_block, layout) if store_gb else None)


def kv_store(store_gb: float, device: DeviceProfile, rank_block_bytes: int, layout: ParallelLayout) -> StoreSpec:
    """The shared store: a block is every rank's shard of it (a DP member's TP x PP ranks)."""
    topology = device.topology
    if topology is None or not topology.has_network:
        raise ValueError(f"kv_store_gb = {store_gb!r}: device {device.name} states no network card to reach the store "
                         f"([topology] inter_bandwidth)")
    block_bytes = rank_block_bytes * layout.tensor_parallel_size * layout.pipeline_parallel_size
    capacity = int(store_gb * GIB) // block_bytes
    if capacity < 1:
        raise ValueError(f"kv_store_gb = {store_gb!r}: holds no block of {block_bytes} bytes")
    return StoreSpec(capacity, topology.inter_bandwidth * topology.inter_efficiency, topology.inter_latency_s,
                     block_bytes, rank_block_bytes)


def _check_policies(resolved: ResolvedRun) -> None:
    """Build the engine once so that an unknown policy, a parameter it does not take, or a
    ``module:Class`` plugin that fails to construct is reported before the run starts."""
    try:
        resolved.new_engine()
    except ValueError:
        raise
    except Exception as exc:
        config = resolved.config
        plugins = [s for s in (config.scheduler, config.block_manager) if ":" in s]
        if not plugins:  # a built-in policy failing is a bug, not the user's mistake
            raise
        raise ValueError(f"plugin {' / '.join(plugins)} failed to construct: {type(exc).__name__}: {exc}") from None


MAX_SPAN_S = 366 * 86400.0  # a trace longer than a year is a unit or timestamp mistake


def load_run_trace(config: RunConfig) -> Trace:
    """The run's trace: a file (in ``trace_format`` or detected) or a bundled sample by name,
    cut to ``max_requests`` and with its rate scaled by ``rate_scale`` or to ``request_rate``.

    Refuses a trace whose arrivals are negative or span more than a year once scaled (a
    timestamp in the wrong unit, or a rate near zero), and, for a prefix-caching run, prefix
    hashes whose block size the engine's block size cannot map onto.
    """
    if config.request_rate is not None and config.rate_scale != 1.0:
        raise ValueError(f"give request_rate ({config.request_rate:g} req/s) or rate_scale ({config.rate_scale:g}), not both")
    trace = traces.load(config.trace, config.trace_format) if config.trace_format else traces.load_named(config.trace)
    if config.max_requests:
        trace = traces.first(trace, config.max_requests)
    factor = config.rate_scale
    if config.request_rate is not None:
        factor = config.request_rate / _mean_rate(trace, config.trace)
    if factor != 1.0:
        trace = traces.scale_rate(trace, factor)
    _check_arrivals(trace, config, factor)
    if trace.hash_block_size and config.normalized().block_manager == "prefix":
        block_size = run_block_size(config)
        try:
            check_block_size_compatible(block_size, trace.hash_block_size)
        except ValueError as exc:
            raise ValueError(f"{config.trace}: block_size {block_size}: {exc}") from None
    return trace


def _mean_rate(trace: Trace, name: str) -> float:
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) if len(trace) else 0.0
    if len(trace) < 2 or span <= 0:
        raise ValueError(f"{name}: request_rate needs a trace whose arrivals span some time ({len(trace)} requests over {span:g} s)")
    return (len(trace) - 1) / span


def _check_arrivals(trace: Trace, config: RunConfig, factor: float) -> None:
    arrivals = trace.arrival_s
    if not len(arrivals):
        raise ValueError(f"{config.trace}: the trace has no requests")
    bad = np.flatnonzero(~np.isfinite(arrivals) | (arrivals < 0))
    if len(bad):
        raise ValueError(f"{config.trace}: request {bad[0] + 1} arrives at {float(arrivals[bad[0]]):g} s; arrivals must be finite and >= 0")
    span = float(arrivals[-1] - arrivals[0])
    if span > MAX_SPAN_S:
        gap = int(np.argmax(np.diff(arrivals)))
        scaled = f" (rate scaled by {factor:g})" if factor != 1.0 else ""
        raise ValueError(
            f"{config.trace}: arrivals span {span:.3g} s{scaled}, over a year; the widest gap is "
            f"{float(arrivals[gap + 1] - arrivals[gap]):.3g} s between requests {gap + 1} and {gap + 2} in arrival order: "
            "a negative or far-future timestamp, a timestamp in the wrong unit (see --time-unit), or a rate near zero"
        )
