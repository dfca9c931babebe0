"""The pre-paging baseline: one contiguous, worst-case-sized region per request.

Each admitted request reserves a region sized for ``max_model_len`` tokens (or, with
``reserve="request"``, for its own prompt plus output, an oracle that real servers lack),
placed first-fit in one linear space. Regions are block-aligned so the same paged kernels
run them, but nothing is shared and a region never grows: the unused tail of every region
is internal waste, and the holes between regions are external fragmentation.
"""

from __future__ import annotations

import bisect

from kvsim.policies.block_manager import (
    BlockManager,
    DecodeFastPath,
    DecodeOutlook,
    KVStats,
)
from kvsim.policies.blocks import cdiv
from kvsim.policies.registry import register_block_manager
from kvsim.policies.request import Request


@register_block_manager("contiguous")
class ContiguousBlockManager(BlockManager, DecodeFastPath):
    def __init__(
        self, num_blocks: int, block_size: int, num_host_blocks: int = 0, max_model_len: int = 4096, reserve: str = "max_model_len"
    ) -> None:
        super().__init__(num_blocks, block_size, num_host_blocks)
        if reserve not in ("max_model_len", "request"):
            raise ValueError(f"contiguous: reserve must be 'max_model_len' or 'request', not {reserve!r}")
        self.max_model_len = max_model_len
        self.reserve = reserve
        self.extents: list[tuple[int, int]] = [(0, num_blocks)]  # free (start, length), sorted by start
        self.regions: dict[str, tuple[int, int]] = {}  # request_id -> (start block, reserved blocks)
        self.used_blocks: dict[str, int] = {}  # request_id -> blocks holding tokens

    def _region_blocks(self, request: Request) -> int:
        tokens = self.max_model_len if self.reserve == "max_model_len" else request.max_kv_tokens
        return cdiv(tokens, self.block_size)

    def choose_extent(self, n: int) -> int | None:
        """The placement rule: which free extent (index into ``extents``) a new ``n``-block region
        takes, None if none holds it. First fit, the lowest; a subclass may choose otherwise."""
        return next((i for i, (_, length) in enumerate(self.extents) if length >= n), None)

    def _place(self, n: int) -> int | None:
        i = self.choose_extent(n)
        if i is None:
            return None
        start, length = self.extents[i]
        if length == n:
            del self.extents[i]
        else:
            self.extents[i] = (start + n, length - n)
        return start

    def _release_extent(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.extents, (start, 0))
        self.extents.insert(i, (start, n))
        if i + 1 < len(self.extents) and start + n == self.extents[i + 1][0]:
            self.extents[i] = (start, n + self.extents[i + 1][1])
            del self.extents[i + 1]
        if i > 0 and self.extents[i - 1][0] + self.extents[i - 1][1] == start:
            prev_start, prev_len = self.extents[i - 1]
            self.extents[i - 1] = (prev_start, prev_len + self.extents[i][1])
            del self.extents[i]

    def _largest_extent(self) -> int:
        return max((length for _, length in self.extents), default=0)

    def can_ever_fit(self, request: Request) -> bool:
        return request.max_kv_tokens <= self.max_model_len and self._region_blocks(request) <= self.num_blocks

    def num_available_blocks(self) -> int:
        return self._largest_extent()

    def blocks_needed(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        return 0 if request.request_id in self.regions else self._region_blocks(request)

    def allocate_slots(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> bool:
        seq = request.request_id
        if seq not in self.regions:
            n = self._region_blocks(request)
            start = self._place(n)
            if start is None:
                return False
            self.regions[seq] = (start, n)
            self.used_blocks[seq] = 0
            if request.num_preemptions == 0:
                self.prefix_query_tokens += request.num_tokens
        start, n = self.regions[seq]
        tokens = request.num_computed_tokens + num_new_tokens
        if tokens > n * self.block_size:  # cannot happen when can_ever_fit held at admission
            return False
        self.used_blocks[seq] = max(self.used_blocks[seq], cdiv(tokens, self.block_size))
        return True

    def _free_device(self, request: Request) -> None:
        region = self.regions.pop(request.request_id, None)
        self.used_blocks.pop(request.request_id, None)
        if region is not None:
            self._release_extent(*region)

    def fork(self, parent: Request, child: Request) -> None:
        """No sharing: the child gets its own region and a copy of the parent's filled blocks.

        When no region is free the child is given none; the scheduler then finds it without
        blocks and preempts or requeues it like any request that cannot allocate.
        """
        n = self._region_blocks(child)
        start = self._place(n)
        if start is None:
            return
        self.regions[child.request_id] = (start, n)
        parent_start, _ = self.regions[parent.request_id]
        used = self.used_blocks[parent.request_id]
        self.used_blocks[child.request_id] = used
        self._pending_copies.extend((parent_start + i, start + i) for i in range(used))
        self.num_copies += used

    def block_table(self, request: Request) -> list[int]:
        region = self.regions.get(request.request_id)
        if region is None:
            return []
        return list(range(region[0], region[0] + self.used_blocks[request.request_id]))

    def _take_blocks_for_swap_in(self, request: Request, n: int) -> list[int] | None:
        size = self._region_blocks(request)
        start = self._place(size)
        if start is None:
            return None
        self.regions[request.request_id] = (start, size)
        self.used_blocks[request.request_id] = n
        return list(range(start, start + n))

    def decode_outlook(self, request: Request, num_steps: int) -> DecodeOutlook | None:
        """A decode's region is reserved: ``allocate_slots`` only counts one more used block at each boundary."""
        first = -request.num_computed_tokens % self.block_size
        return DecodeOutlook(range(first, num_steps, self.block_size), range(0))

    def pool_counts(self) -> tuple[int, int, int]:
        reserved = self.num_blocks - sum(length for _, length in self.extents)
        return reserved, 0, self.num_blocks - reserved

    def internal_waste(self, live: list[Request], computed_tokens: int | None = None) -> int:
        reserved = self.num_blocks - sum(length for _, length in self.extents)
        return reserved * self.block_size - sum(r.num_computed_tokens for r in live if r.request_id in self.regions)

    def stats(self, live: list[Request]) -> KVStats:
        reserved, _, free_blocks = self.pool_counts()
        largest = self._largest_extent()
        return KVStats(
            num_blocks=self.num_blocks,
            used=reserved,
            cached=0,
            free=free_blocks,
            internal_waste_slots=self.internal_waste(live),
            fragmentation=(1.0 - largest / free_blocks) if free_blocks else 0.0,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=0,
            resume_hit_blocks=0,
            evictions=0,
            copies=self.num_copies,
            swapped_out_blocks=self.swapped_out_blocks,
            swapped_in_blocks=self.swapped_in_blocks,
            host_blocks_used=self.host.num_blocks - self.host.num_free,
        )

    def check_invariants(self, live: list[Request]) -> None:
        assert set(self.regions) <= {r.request_id for r in live}, "a region belongs to no live request"
        spans = sorted(self.regions.values()) + list(self.extents)
        spans.sort()
        position = 0
        for start, length in spans:
            assert start == position, f"regions and free extents overlap or leave a gap at block {position}"
            position = start + length
        assert position == self.num_blocks, "regions and free extents do not cover the pool"
        for req in live:
            if req.request_id in self.regions:
                assert self.used_blocks[req.request_id] * self.block_size >= req.num_computed_tokens
