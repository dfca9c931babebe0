"""Paged KV blocks from a free pool, with optional automatic prefix caching.

One pool serves both registered managers: ``paged`` (blocks are plain storage) and
``prefix`` (full blocks are also indexed by their chained hash, as vLLM V1's BlockPool):
a new request reuses every leading cached block (ref count + 1, no copy); blocks whose
ref count drops to zero stay cached and sit in an LRU free queue, evicted from its head
only when an allocation needs room; a fork shares every block, and a write into a shared,
partially filled block copies it first (copy-on-write).
"""

from __future__ import annotations

from collections import OrderedDict

from kvsim.policies.block_manager import BlockManager, KVStats
from kvsim.policies.hashing import check_block_size_compatible, extend_block_hashes
from kvsim.policies.registry import register_block_manager
from kvsim.policies.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@register_block_manager("paged")
class PagedBlockManager(BlockManager):
    enable_caching = False

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, num_host_blocks)
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cache_map: dict[int, int] = {}
        # Unreferenced blocks, least recently freed first: the eviction order.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached_idle = 0
        self.evictions = 0
        self.tables: dict[int, list[int]] = {}
        self.hashes: dict[int, list[int]] = {}
        self.num_registered: dict[int, int] = {}

    # --- pool primitives ---------------------------------------------------------------
    def _pop_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            if self.cache_map.get(h) == block:
                del self.cache_map[h]
            self.block_hash[block] = None
            self.num_cached_idle -= 1
            self.evictions += 1
        self.ref_cnt[block] = 1
        return block

    def _touch(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
            if self.block_hash[block] is not None:
                self.num_cached_idle -= 1
        self.ref_cnt[block] += 1

    def _release(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_queue[block] = None
            if self.block_hash[block] is not None:
                self.num_cached_idle += 1

    # --- capacity ------------------------------------------------------------------------
    def can_ever_fit(self, request: Request) -> bool:
        return cdiv(request.max_kv_tokens, self.block_size) <= self.num_blocks

    def num_available_blocks(self) -> int:
        return len(self.free_queue)

    def _hit_blocks(self, request: Request, num_hit_tokens: int) -> list[int]:
        hashes = self.hashes[request.seq_id]
        return [self.cache_map[hashes[j]] for j in range(num_hit_tokens // self.block_size)]

    def _needs_copy(self, table: list[int], first_write: int) -> bool:
        idx = first_write // self.block_size
        return first_write % self.block_size != 0 and idx < len(table) and self.ref_cnt[table[idx]] > 1

    def blocks_needed(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        table = self.tables.get(request.seq_id, ())
        hit_blocks = self._hit_blocks(request, num_hit_tokens) if num_hit_tokens else []
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        new = max(0, cdiv(total, self.block_size) - len(table) - len(hit_blocks))
        cow = self._needs_copy(table, request.num_computed_tokens + num_hit_tokens)
        evictable_hits = sum(1 for b in hit_blocks if self.ref_cnt[b] == 0)
        return new + cow + evictable_hits

    # --- per-request operations -----------------------------------------------------------
    def lookup(self, request: Request) -> int:
        if not self.enable_caching:
            return 0
        if request.hash_block_size:
            check_block_size_compatible(self.block_size, request.hash_block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(self.hashes.setdefault(request.seq_id, []), request, max_blocks, self.block_size)
        hits = 0
        while hits < max_blocks and hashes[hits] in self.cache_map:
            hits += 1
        return hits * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> bool:
        seq = request.seq_id
        table = self.tables.get(seq)
        if num_new_tokens == 1 and table is not None and not num_hit_tokens:
            # The hot path: one decode token landing inside an unshared block that it does not
            # fill, with every earlier full block already offered to the cache (not so right after
            # a swap-in), changes nothing: nothing to allocate, copy or register.
            pos = request.num_computed_tokens
            bs = self.block_size
            registered = not self.enable_caching or ((pos + 1) % bs and self.num_registered[seq] == pos // bs)
            if pos % bs and registered and self.ref_cnt[table[pos // bs]] == 1:
                return True
        if self.blocks_needed(request, num_new_tokens, num_hit_tokens) > len(self.free_queue):
            return False
        if table is None:
            table = self.tables[seq] = []
            self.num_registered[seq] = 0
            if request.num_preemptions == 0:  # as vLLM's hit rate: re-admissions are not queries
                self.prefix_query_tokens += request.num_tokens
                self.prefix_hit_tokens += num_hit_tokens
        if num_hit_tokens:
            for block in self._hit_blocks(request, num_hit_tokens):
                self._touch(block)
                table.append(block)
            self.num_registered[seq] = len(table)
        first_write = request.num_computed_tokens + num_hit_tokens
        if self._needs_copy(table, first_write):
            idx = first_write // self.block_size
            src, dst = table[idx], self._pop_free_block()
            self._release(src)
            table[idx] = dst
            self._pending_copies.append((src, dst))
            self.num_copies += 1
        total = first_write + num_new_tokens
        for _ in range(cdiv(total, self.block_size) - len(table)):
            table.append(self._pop_free_block())
        if self.enable_caching:
            self._register_full_blocks(request, table, min(total, request.num_tokens) // self.block_size)
        return True

    def _register_full_blocks(self, request: Request, table: list[int], num_full: int) -> None:
        seq = request.seq_id
        start = self.num_registered[seq]
        if num_full <= start:
            return
        hashes = extend_block_hashes(self.hashes.setdefault(seq, []), request, num_full, self.block_size)
        for j in range(start, num_full):
            h, block = hashes[j], table[j]
            if h not in self.cache_map and self.block_hash[block] is None:
                self.cache_map[h] = block
                self.block_hash[block] = h
        self.num_registered[seq] = num_full

    def free(self, request: Request) -> None:
        seq = request.seq_id
        table = self.tables.pop(seq, None)
        self.num_registered.pop(seq, None)
        self.hashes.pop(seq, None)
        if table:
            # Blocks are hashed when allocated, before the step computes them; a request freed
            # in between (preempted after its allocation this step) never wrote them.
            for block in table[request.num_computed_tokens // self.block_size :]:
                self._forget_hash(block)
            for block in reversed(table):  # tail blocks first: they are evicted first
                self._release(block)

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cache_map[h]
            self.block_hash[block] = None

    def fork(self, parent: Request, child: Request) -> None:
        table = self.tables[parent.seq_id]
        for block in table:
            self.ref_cnt[block] += 1
        self.tables[child.seq_id] = list(table)
        self.hashes[child.seq_id] = list(self.hashes.get(parent.seq_id, []))
        self.num_registered[child.seq_id] = self.num_registered[parent.seq_id]

    def block_table(self, request: Request) -> list[int]:
        return self.tables.get(request.seq_id, [])

    def _take_blocks_for_swap_in(self, request: Request, n: int) -> list[int] | None:
        if n > len(self.free_queue):
            return None
        self.tables[request.seq_id] = [self._pop_free_block() for _ in range(n)]
        self.num_registered[request.seq_id] = 0
        return list(self.tables[request.seq_id])

    def decode_bookkeeping_steps(self, request: Request, num_steps: int) -> range:
        if not self.enable_caching:
            return range(0)
        return range((-request.num_computed_tokens - 1) % self.block_size, num_steps, self.block_size)

    def decode_write_needs_copy(self, request: Request) -> bool:
        return self._needs_copy(self.tables.get(request.seq_id, []), request.num_computed_tokens)

    # --- observation ---------------------------------------------------------------------
    def pool_counts(self) -> tuple[int, int, int]:
        free_total = len(self.free_queue)
        return self.num_blocks - free_total, self.num_cached_idle, free_total - self.num_cached_idle

    def internal_waste(self, live: list[Request]) -> int:
        filled_in_last: dict[int, int] = {}  # a forked, shared last block counts once
        for req in live:
            table = self.tables.get(req.seq_id)
            if table:
                last = table[-1]
                filled = req.num_computed_tokens - (len(table) - 1) * self.block_size
                filled_in_last[last] = max(filled_in_last.get(last, 0), min(max(filled, 0), self.block_size))
        return sum(self.block_size - f for f in filled_in_last.values())

    def stats(self, live: list[Request]) -> KVStats:
        used, cached, free = self.pool_counts()
        return KVStats(
            num_blocks=self.num_blocks,
            used=used,
            cached=cached,
            free=free,
            internal_waste_slots=self.internal_waste(live),
            fragmentation=0.0,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            evictions=self.evictions,
            copies=self.num_copies,
            swapped_out_blocks=self.swapped_out_blocks,
            swapped_in_blocks=self.swapped_in_blocks,
            host_blocks_used=self.host.num_blocks - self.host.num_free,
        )

    def check_invariants(self, live: list[Request]) -> None:
        holders = [0] * self.num_blocks
        for req in live:
            table = self.tables.get(req.seq_id, [])
            assert len(set(table)) == len(table), f"request {req.request_id}: block table repeats a block"
            assert len(table) * self.block_size >= req.num_computed_tokens, (
                f"request {req.request_id}: table of {len(table)} blocks does not cover {req.num_computed_tokens} tokens"
            )
            for block in table:
                holders[block] += 1
        assert set(self.tables) <= {r.seq_id for r in live}, "a table belongs to no live request"
        assert holders == self.ref_cnt, "ref counts differ from the number of tables holding each block"
        assert set(self.free_queue) == {b for b in range(self.num_blocks) if self.ref_cnt[b] == 0}, (
            "free queue differs from the unreferenced blocks"
        )
        assert self.num_cached_idle == sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        for h, block in self.cache_map.items():
            assert self.block_hash[block] == h, f"cache map entry for block {block} disagrees with its hash"
        assert sum(1 for h in self.block_hash if h is not None) == len(self.cache_map)


@register_block_manager("prefix")
class PrefixCachingBlockManager(PagedBlockManager):
    enable_caching = True
