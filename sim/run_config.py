"""A run's full configuration: trace, model, device, pool sizing and policies.

A run is fixed by this and its seed. It comes from a TOML file (``--config run.toml``, the
same field names, policy parameters in ``[scheduler_params]`` / ``[block_manager_params]``)
with command-line options on top, and it is written back, resolved, into ``summary.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from kvsim import traces
from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.sim.cost_model import CostModel
from kvsim.sim.device import DeviceProfile, load_device
from kvsim.sim.memory import MemoryPlan, plan_memory
from kvsim.sim.model_spec import ModelSpec, load_model
from kvsim.sim.toml_io import load_toml
from kvsim.traces.schema import Trace

GIB = 2**30


@dataclass
class RunConfig:
    trace: str = "demo"  # a path, or the name of a bundled sample
    trace_format: str | None = None
    rate_scale: float = 1.0  # what-if: arrivals this many times as frequent (2.0 = twice the traffic)
    max_requests: int = 0  # replay only the first N requests; 0 = all
    model: str = "llama-2-7b"
    device: str = "ascend-910b3"
    scheduler: str = "fcfs"
    scheduler_params: dict = field(default_factory=dict)
    block_manager: str = "prefix"
    block_manager_params: dict = field(default_factory=dict)
    block_size: int = 128  # the Ascend paged kernels' recommended size
    kv_dtype: str | None = None  # None: the model's
    memory_utilization: float = 0.9
    num_blocks: int = 0  # 0: sized by the memory model
    max_model_len: int | None = None  # None: the model's maximum
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    swap_space_gb: float = 4.0  # vLLM's default swap space
    watermark: float = 0.0
    max_waiting: int = 0
    long_prefill_token_threshold: int = 0
    batch_blocks_within_pool: bool = False  # Ascend FIA's limit (policies.config); execute/validate set it for npu
    seed: int = 0
    exact: bool = False

    def updated(self, **overrides) -> "RunConfig":
        """A copy with every override that is not None applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)


def load_run_config(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """``base`` (default: RunConfig()) with the TOML file's fields on top.

    A ``[validation]`` table (thresholds for ``kvsim validate``) is read separately.
    """
    data = load_toml(path)
    data.pop("validation", None)
    allowed = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    return replace(base or RunConfig(), **data)


@dataclass
class ResolvedRun:
    """A RunConfig with its model, device and memory plan looked up and the engine config built."""

    config: RunConfig
    model: ModelSpec
    device: DeviceProfile
    memory: MemoryPlan
    engine_config: EngineConfig

    def new_engine(self) -> EngineCore:
        return EngineCore(self.engine_config)

    def cost_model(self) -> CostModel:
        """The cost model for this run's model, device, block size and KV dtype."""
        return CostModel(self.model, self.device, self.config.block_size, self.memory.kv_dtype)

    def to_dict(self) -> dict:
        return {
            **self.config.to_dict(),
            "resolved": {
                "kv_dtype": self.memory.kv_dtype,
                "max_model_len": self.engine_config.max_model_len,
                "num_blocks": self.engine_config.num_blocks,
                "num_host_blocks": self.engine_config.num_host_blocks,
                "bytes_per_block": self.memory.bytes_per_block,
                "kv_pool_bytes": self.engine_config.num_blocks * self.memory.bytes_per_block,
            },
        }


def resolve(config: RunConfig, search_dirs: tuple[str | Path, ...] = (".",)) -> ResolvedRun:
    """Look up the model and device and size the KV pool exactly as an engine would."""
    model = load_model(config.model)
    device = load_device(config.device, search_dirs=search_dirs)
    memory = plan_memory(
        model,
        device,
        kv_dtype=config.kv_dtype,
        block_size=config.block_size,
        memory_utilization=config.memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
    )
    num_blocks = config.num_blocks or memory.require_fit().num_blocks
    engine_config = EngineConfig(
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_host_blocks=int(config.swap_space_gb * GIB) // memory.bytes_per_block,
        max_model_len=memory.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        scheduler=config.scheduler,
        scheduler_params=dict(config.scheduler_params),
        block_manager=config.block_manager,
        block_manager_params=dict(config.block_manager_params),
        preemption_mode=config.preemption_mode,
        watermark=config.watermark,
        max_waiting=config.max_waiting,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        batch_blocks_within_pool=config.batch_blocks_within_pool,
    )
    return ResolvedRun(config, model, device, memory, engine_config)


def load_run_trace(config: RunConfig) -> Trace:
    """The run's trace: a file (in ``trace_format`` or detected) or a bundled sample by name,
    cut to ``max_requests`` and with its rate scaled by ``rate_scale``."""
    trace = traces.load(config.trace, config.trace_format) if config.trace_format else traces.load_named(config.trace)
    if config.max_requests:
        trace = traces.first(trace, config.max_requests)
    if config.rate_scale != 1.0:
        trace = traces.scale_rate(trace, config.rate_scale)
    return trace
