"""The pools below the KV managers: device blocks (ref counts, LRU free queue, prefix index)
and host swap slots.

As vLLM V1's ``BlockPool``: a block is free when no request references it; free blocks wait
in one queue, least recently freed first, and allocation takes the head. A free block may
still hold a cached prefix (its hash maps to it); it stays reusable until allocation evicts
it from the head of the queue. Every operation is O(1).
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block holding that prefix
        # Unreferenced blocks, least recently freed first: the eviction order.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached_free = 0  # free blocks that still hold a cached prefix
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and evictable cached ones."""
        return len(self.free_queue)

    def allocate(self) -> int:
        """Take the head of the free queue (evicting its cached prefix), referenced once."""
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.num_cached_free -= 1
            self.evictions += 1
        self.ref_cnt[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free queue, as ``n`` calls of :meth:`allocate` take them."""
        if self.num_cached_free:
            return [self.allocate() for _ in range(n)]
        # No free block holds a prefix: nothing to evict, so only the queue and the counts move.
        pop, ref_cnt = self.free_queue.popitem, self.ref_cnt
        blocks = [pop(False)[0] for _ in range(n)]
        for block in blocks:
            ref_cnt[block] = 1
        return blocks

    def touch(self, block: int) -> None:
        """One more reference (a prefix hit or a fork); a free block leaves the queue."""
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
            if self.block_hash[block] is not None:
                self.num_cached_free -= 1
        self.ref_cnt[block] += 1

    def release(self, block: int) -> None:
        """One reference fewer; at zero the block joins the tail of the free queue."""
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_queue[block] = None
            if self.block_hash[block] is not None:
                self.num_cached_free += 1

    def release_many(self, blocks) -> None:
        """:meth:`release` each of ``blocks``, in their order."""
        ref_cnt, free_queue, block_hash = self.ref_cnt, self.free_queue, self.block_hash
        for block in blocks:
            ref_cnt[block] -= 1
            if ref_cnt[block] == 0:
                free_queue[block] = None
                if block_hash[block] is not None:
                    self.num_cached_free += 1

    def cache(self, block: int, h: int) -> None:
        """Index a full block by its chained hash, unless that prefix or block is indexed already."""
        if h not in self.cached and self.block_hash[block] is None:
            self.cached[h] = block
            self.block_hash[block] = h

    def uncache(self, block: int) -> None:
        """Forget the prefix a referenced block was indexed under (it was never written)."""
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None

    def counts(self) -> tuple[int, int, int]:
        """(used, cached, free): referenced, free holding a prefix, free and empty."""
        free_total = len(self.free_queue)
        return self.num_blocks - free_total, self.num_cached_free, free_total - self.num_cached_free

    def check_invariants(self, holders: list[int]) -> None:
        """``holders[b]``: how many block tables hold block ``b``."""
        assert holders == self.ref_cnt, "ref counts differ from the number of tables holding each block"
        assert set(self.free_queue) == {b for b in range(self.num_blocks) if self.ref_cnt[b] == 0}, (
            "free queue differs from the unreferenced blocks"
        )
        assert self.num_cached_free == sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        for h, block in self.cached.items():
            assert self.block_hash[block] == h, f"cache index entry for block {block} disagrees with its hash"
        assert sum(1 for h in self.block_hash if h is not None) == len(self.cached)


class HostPool:
    """Host-memory swap space: ``num_blocks`` block-sized slots, allocated lowest id first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
