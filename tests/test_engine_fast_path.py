"""The decode batch's fast path is opt-in: a block manager without ``DecodeFastPath`` still runs.

A plug-in written against ``BlockManager`` alone is asked ``allocate_slots`` for every running
request every step (the general path); the same manager opting in with a ``decode_outlook``
that keeps the contract gets the persistent decode batch, and both decide exactly the same.
"""

from __future__ import annotations

from kvsim.policies.block_manager import (
    BlockManager,
    DecodeFastPath,
    DecodeOutlook,
    KVStats,
)
from kvsim.policies.blocks import cdiv
from kvsim.policies.plan import PlanDetail
from kvsim.policies.registry import register_block_manager
from kvsim.policies.request import Request


@register_block_manager("test-plain-paged")
class PlainPaged(BlockManager):
    """The least a paged manager needs: a free list, one table a request, no sharing (a fork
    gives the child no blocks, so it starts over) and no prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, num_host_blocks)
        self.free_blocks = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    def can_ever_fit(self, request: Request) -> bool:
        return cdiv(request.max_kv_tokens, self.block_size) <= self.num_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        return max(0, cdiv(tokens, self.block_size) - len(self.block_table(request)))

    def num_available_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> bool:
        n = self.blocks_needed(request, num_new_tokens, num_hit_tokens)
        if n > len(self.free_blocks):
            return False
        self.tables.setdefault(request.request_id, []).extend(self.free_blocks.pop() for _ in range(n))
        return True

    def _free_device(self, request: Request) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(request.request_id, [])))

    def fork(self, parent: Request, child: Request) -> None:
        """No sharing: the child gets no blocks."""

    def block_table(self, request: Request) -> list[int]:
        return self.tables.get(request.request_id, [])

    def _take_blocks_for_swap_in(self, request: Request, n: int) -> list[int] | None:
        if n > len(self.free_blocks):
            return None
        self.tables[request.request_id] = [self.free_blocks.pop() for _ in range(n)]
        return list(self.tables[request.request_id])

    def pool_counts(self) -> tuple[int, int, int]:
        return self.num_blocks - len(self.free_blocks), 0, len(self.free_blocks)

    def internal_waste(self, live: list[Request], computed_tokens: int | None = None) -> int:
        held = sum(len(self.block_table(r)) for r in live) * self.block_size
        return held - sum(r.num_computed_tokens for r in live if self.block_table(r))

    def stats(self, live: list[Request]) -> KVStats:
        used, cached, free = self.pool_counts()
        return KVStats(self.num_blocks, used, cached, free, self.internal_waste(live), 0.0, 0, 0, 0, 0, 0,
                       self.swapped_out_blocks, self.swapped_in_blocks, self.host.num_blocks - self.host.num_free)

    def check_invariants(self, live: list[Request]) -> None:
        held = [b for table in self.tables.values() for b in table]
        assert sorted(held + self.free_blocks) == list(range(self.num_blocks)), "a block lost or held twice"


@register_block_manager("test-plain-paged-fast")
class PlainPagedFast(PlainPaged, DecodeFastPath):
    """The same manager opting in: a decode's ``allocate_slots`` acts only when it opens a block."""

    def decode_outlook(self, request: Request, num_steps: int) -> DecodeOutlook | None:
        return DecodeOutlook(range(-request.num_computed_tokens % self.block_size, num_steps, self.block_size), range(0))


WORKLOAD = [(30, 5, 1), (1, 9, 1), (9, 6, 2), (17, 8, 1), (5, 3, 3), (6, 12, 1)]  # chunks, forks, preemption


def test_a_manager_without_the_fast_path_decides_the_same(make_engine, step_all) -> None:
    geometry = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 6, "num_blocks": 12}
    general = step_all(make_engine(block_manager="test-plain-paged", **geometry), WORKLOAD, PlanDetail.SLOTS, check=True)
    fast = step_all(make_engine(block_manager="test-plain-paged-fast", **geometry), WORKLOAD, PlanDetail.SLOTS, check=True)
    assert any(p.preempted for p in general) and any(p.forks for p in general)
    assert [p.to_json() for p in general] == [p.to_json() for p in fast]


def test_only_a_manager_that_opts_in_gets_the_decode_batch(make_engine, step_all) -> None:
    geometry = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 6, "num_blocks": 12}
    general = step_all(make_engine(block_manager="test-plain-paged", **geometry), WORKLOAD, PlanDetail.TOTALS, check=True)
    fast = step_all(make_engine(block_manager="test-plain-paged-fast", **geometry), WORKLOAD, PlanDetail.TOTALS, check=True)
    assert sum(p.batch_decodes for p in general) == 0 < sum(p.batch_decodes for p in fast)
    assert [p.totals for p in general] == [p.totals for p in fast]
