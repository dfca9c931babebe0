"""Prefill-first scheduling: vLLM V0's default scheduler and vllm-ascend's AscendScheduler.

vLLM V0 (``vllm/core/scheduler.py``, ``_schedule_default``) and vllm-ascend's AscendScheduler
(``vllm_ascend/core/scheduler.py``, which vllm-ascend v0.9.x turns on by default for non-MLA
models on the V1 engine, with chunked prefill off and ``max_num_batched_tokens`` raised to
``max_model_len``) run a step of prefills whenever a waiting prompt fits, whole prompts only,
up to the token budget and ``max_num_seqs``; running requests decode only in steps with no
prefill. Decodes therefore stall while prompts are admitted, which is what TPOT under load
measures on those engines.

The engine keeps one step algorithm (running requests first, then admission): this policy
makes it prefill-first by giving the running pass nobody when the head of the waiting queue
will be admitted. The admission test mirrors the engine's without prefix-cache hits, so it
never promises a prefill the engine then refuses (hits only make a prompt need fewer blocks);
it is exact for the paged block managers (``paged``, ``prefix``).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvsim.policies.blocks import cdiv
from kvsim.policies.registry import register_scheduler
from kvsim.policies.request import Request
from kvsim.policies.schedulers import SchedulerPolicy
from kvsim.policies.view import EngineView


@register_scheduler("vllm-v0")
class PrefillFirstPolicy(SchedulerPolicy):
    """Whole prompts first, in steps of their own; decode steps only when no prompt fits."""

    def __init__(self, chunked_prefill: bool = False) -> None:
        if chunked_prefill:
            raise ValueError("scheduler 'vllm-v0' runs whole prompts: enable_chunked_prefill = true needs fcfs")
        super().__init__(chunked_prefill=False)

    def running_order(self, view: EngineView) -> Iterable[Request]:
        return () if self.prefill_step(view) else view.running

    def prefill_step(self, view: EngineView) -> bool:
        """Will this step admit the head of the waiting queue (so it runs prefills only)?"""
        if view.swapped or not view.waiting or not self.admission_open(view):
            return False  # swapped requests come back before any new prompt (as in V0)
        head = next(iter(self.waiting_order(view.waiting, view)))
        cfg = view.config
        seats = view.running_seats + head.seats
        if seats > self.admission_limit(view):
            return False
        tokens = head.num_tokens - head.num_computed_tokens  # whole prompt (plus outputs after a recompute)
        if tokens > min(cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens):
            return False
        blocks = cdiv(head.num_tokens, cfg.block_size)
        if cfg.batch_blocks_within_pool and blocks > cfg.num_blocks:
            return False
        return view.num_free_blocks - blocks >= cfg.watermark_blocks
