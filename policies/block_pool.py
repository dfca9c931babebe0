"""The pools below the KV managers: device blocks (ref counts, LRU free queue, prefix index)
and host swap slots.

As vLLM V1's ``BlockPool``: a block is free when no request references it; free blocks wait
in one queue, least recently freed first, and allocation takes the head. A free block may
still hold a cached prefix (its hash maps to it); it stays reusable until allocation evicts
it from the head of the queue. Every operation is O(1) (amortised).

The queue is a list read from a head index, each free block's entry stamped with its place:
releasing appends, allocating advances the head, so taking n blocks for a prefill chunk is one
slice. A prefix hit on a free block (``touch``) takes it out of the queue by leaving its entry
stale (the block is referenced, or its stamp is an older place); the head skips stale entries.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable

import numpy as np

_COMPACT_AT = 4096  # consumed entries dropped from the list's front once this many and half of it


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block holding that prefix
        # The free queue, least recently freed first: the eviction order. Entry i of ``_queue`` is
        # place ``_base + i``; it is live while its block is unreferenced and stamped with that place.
        self._queue: list[int] = list(range(num_blocks))
        self._stamp = array("q", range(num_blocks))  # machine ints: a store touches no int object
        self._head = 0
        self._base = 0
        self._stale = 0  # entries at or after the head that are not live
        self.num_cached_free = 0  # free blocks that still hold a cached prefix
        self.evictions = 0
        # Told the prefix of each evicted cached block (KV tiers demote it); None: it just vanishes.
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and evictable cached ones."""
        return len(self._queue) - self._head - self._stale

    def free_blocks(self) -> list[int]:
        """The free queue from its head: the order in which allocation takes blocks."""
        base, stamp, ref_cnt = self._base, self._stamp, self.ref_cnt
        return [b for i, b in enumerate(self._queue[self._head:], self._head)
                if ref_cnt[b] == 0 and stamp[b] == base + i]

    def _take_head(self) -> int:
        queue, stamp, ref_cnt, i = self._queue, self._stamp, self.ref_cnt, self._head
        while True:
            block = queue[i]
            i += 1
            if ref_cnt[block] == 0 and stamp[block] == self._base + i - 1:
                break
            self._stale -= 1
        self._head = i
        return block

    def _compact(self) -> None:
        """Drop the consumed front of the list (amortised O(1): only once it is half of it)."""
        head = self._head
        if head >= _COMPACT_AT and 2 * head >= len(self._queue):
            del self._queue[:head]
            self._base += head
            self._head = 0

    def allocate(self) -> int:
        """Take the head of the free queue (evicting its cached prefix), referenced once."""
        block = self._take_head()
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.on_evict is not None:
                    self.on_evict(h)
            self.block_hash[block] = None
            self.num_cached_free -= 1
            self.evictions += 1
        self.ref_cnt[block] = 1
        self._compact()
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free queue, as ``n`` calls of :meth:`allocate` take them."""
        if self.num_cached_free or self._stale:
            return [self.allocate() for _ in range(n)]
        # Every entry from the head is live and no free block holds a prefix: a slice, nothing to evict.
        head = self._head
        blocks = self._queue[head:head + n]
        self._head = head + n
        ref_cnt = self.ref_cnt
        for block in blocks:
            ref_cnt[block] = 1
        self._compact()
        return blocks

    def touch(self, block: int) -> None:
        """One more reference (a prefix hit or a fork); a free block leaves the queue (its entry goes stale)."""
        if self.ref_cnt[block] == 0:
            self._stale += 1
            if self.block_hash[block] is not None:
                self.num_cached_free -= 1
        self.ref_cnt[block] += 1

    def release(self, block: int) -> None:
        """One reference fewer; at zero the block joins the tail of the free queue."""
        self.release_many((block,))

    def release_many(self, blocks) -> None:
        """:meth:`release` each of ``blocks``, in their order."""
        ref_cnt, queue, stamp = self.ref_cnt, self._queue, self._stamp
        start = len(queue)
        place = self._base + start
        for block in blocks:
            left = ref_cnt[block] - 1
            ref_cnt[block] = left
            if not left:
                stamp[block] = place
                place += 1
                queue.append(block)
        if self.cached:  # a block holds a prefix only while the index maps its hash to it
            block_hash = self.block_hash
            self.num_cached_free += sum(1 for block in queue[start:] if block_hash[block] is not None)

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
        free_total = self.num_free
        return self.num_blocks - free_total, self.num_cached_free, free_total - self.num_cached_free

    def check_invariants(self, holders: list[int]) -> None:
        """``holders[b]``: how many block tables hold block ``b``. Array operations throughout:
        ``--check`` runs this after every step, over every block of the pool."""
        assert holders == self.ref_cnt, "ref counts differ from the number of tables holding each block"
        queue = np.array(self._queue[self._head:], dtype=np.int64)
        ref_cnt = np.array(self.ref_cnt, dtype=np.int64)
        places = np.arange(self._base + self._head, self._base + len(self._queue))
        free = queue[(ref_cnt[queue] == 0) & (np.frombuffer(self._stamp, dtype=np.int64)[queue] == places)]
        assert len(free) == self.num_free, "the free queue's count is off"
        assert np.array_equal(np.sort(free), np.flatnonzero(ref_cnt == 0)), (
            "free queue holds a block twice or differs from the unreferenced blocks"
        )
        block_hash = self.block_hash
        hashes_held = tuple(map(block_hash.__getitem__, self.cached.values()))
        if hashes_held != tuple(self.cached):
            block = next(b for h, b in self.cached.items() if block_hash[b] != h)
            raise AssertionError(f"cache index entry for block {block} disagrees with its hash")
        assert len(block_hash) - block_hash.count(None) == len(self.cached)
        hashed = np.zeros(self.num_blocks, dtype=bool)
        hashed[np.fromiter(self.cached.values(), dtype=np.int64, count=len(self.cached))] = True
        assert self.num_cached_free == int(hashed[free].sum())


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
