"""The engine's configuration: pool geometry, budgets, and which policies run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvsim.policies.kv_tiers import TierConfig


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    num_host_blocks: int = 0  # swap space, in blocks
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduler: str = "fcfs"  # registered name or module:Class
    scheduler_params: dict = field(default_factory=dict)
    block_manager: str = "prefix"
    block_manager_params: dict = field(default_factory=dict)
    preemption_mode: str = "recompute"  # or "swap"
    watermark: float = 0.0  # fraction of blocks admission keeps free for running requests
    max_waiting: int = 0  # waiting-queue cap; 0 = unbounded (beyond it: rejected "queue_full")
    long_prefill_token_threshold: int = 0  # cap on one request's tokens per step; 0 = none
    # Ascend's npu_fused_infer_attention_score rejects a batch whose sum over sequences of
    # ceil(seq_len / block_size) exceeds the cache's block count, even when prefix sharing
    # makes the distinct blocks fewer. On, a step never schedules such a batch.
    batch_blocks_within_pool: bool = False
    kv_tiers: TierConfig | None = None  # host DRAM and SSD under the pool (policies.kv_tiers); None: off

    def __post_init__(self) -> None:
        problems = []
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("num_host_blocks", "max_waiting", "long_prefill_token_threshold"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            problems.append(f"preemption_mode must be 'recompute' or 'swap', not {self.preemption_mode!r}")
        if not 0.0 <= self.watermark < 1.0:
            problems.append(f"watermark must be in [0, 1), not {self.watermark}")
        if problems:
            raise ValueError("engine config: " + "; ".join(problems))

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    def to_dict(self) -> dict:
        return asdict(self)
