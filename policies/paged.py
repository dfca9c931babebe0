"""Paged KV blocks from a free pool, with optional automatic prefix caching.

One pool serves both registered managers: ``paged`` (blocks are plain storage) and
``prefix`` (full blocks are also indexed by their chained hash, as vLLM V1's BlockPool):
a new request reuses every leading cached block (ref count + 1, no copy); blocks whose
ref count drops to zero stay cached and sit in an LRU free queue, evicted from its head
only when an allocation needs room; a fork shares every block, and a write into a shared,
partially filled block copies it first (copy-on-write).

With KV tiers (``kv_tiers``, ``prefix`` only: ``policies.kv_tiers``) an evicted cached block
demotes to host memory or SSD, and a lookup goes on past HBM's last hit through the blocks the
tiers and a shared KV store hold; admission gives those fresh device blocks (a promotion) instead
of recomputing them. Computed blocks are also put into the store.
"""

from __future__ import annotations

from operator import attrgetter

from kvsim.policies.block_manager import BlockManager, DecodeFastPath, DecodeOutlook, KVStats
from kvsim.policies.block_pool import BlockPool
from kvsim.policies.blocks import cdiv
from kvsim.policies.hashing import check_block_size_compatible, extend_block_hashes
from kvsim.policies.kv_tiers import KVTiers, TierConfig
from kvsim.policies.registry import register_block_manager
from kvsim.policies.request import Request

_num_computed = attrgetter("num_computed_tokens")


@register_block_manager("paged")
class PagedBlockManager(BlockManager, DecodeFastPath):
    enable_caching = False

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 kv_tiers: TierConfig | None = None) -> None:
        super().__init__(num_blocks, block_size, num_host_blocks)
        self.pool = BlockPool(num_blocks)
        self.tiers: KVTiers | None = None
        if kv_tiers is not None:
            if not self.enable_caching:
                raise ValueError("KV tiers hold cached prefixes: they need the prefix block manager, not paged")
            self.tiers = KVTiers(kv_tiers, device_index=self.pool.cached)
            self.pool.on_evict = self.tiers.demote
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[int]] = {}  # each request's block-hash chain so far
        self.num_registered: dict[str, int] = {}  # leading blocks already offered to the cache
        self.num_table_blocks = 0  # sum of every table's length (a shared block once per table)
        self.forked: set[str] = set()  # requests whose last block a fork may share

    # --- capacity ------------------------------------------------------------------------
    def can_ever_fit(self, request: Request) -> bool:
        return cdiv(request.max_kv_tokens, self.block_size) <= self.num_blocks

    def num_available_blocks(self) -> int:
        return self.pool.num_free

    def _hit_blocks(self, request: Request, num_hit_tokens: int) -> list[int | None]:
        """The device blocks of the hit; with tiers, None where a tier holds the block instead."""
        hashes, cached = self.hashes[request.request_id], self.pool.cached
        if self.tiers is None:
            return [cached[hashes[j]] for j in range(num_hit_tokens // self.block_size)]
        return [cached.get(hashes[j]) for j in range(num_hit_tokens // self.block_size)]

    def _needs_copy(self, table: list[int], first_write: int) -> bool:
        idx = first_write // self.block_size
        return first_write % self.block_size != 0 and idx < len(table) and self.pool.ref_cnt[table[idx]] > 1

    def blocks_needed(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        table = self.tables.get(request.request_id, ())
        first_write = request.num_computed_tokens + num_hit_tokens
        new = cdiv(first_write + num_new_tokens, self.block_size) - len(table)
        evictable_hits = 0
        if num_hit_tokens:
            hit_blocks = self._hit_blocks(request, num_hit_tokens)
            if self.tiers is not None:  # a block promoted from a tier takes a fresh one: it stays in ``new``
                hit_blocks = [b for b in hit_blocks if b is not None]
            new -= len(hit_blocks)
            evictable_hits = sum(1 for b in hit_blocks if self.pool.ref_cnt[b] == 0)
        return max(0, new) + self._needs_copy(table, first_write) + evictable_hits

    # --- per-request operations -----------------------------------------------------------
    def lookup(self, request: Request) -> int:
        if not self.enable_caching:
            return 0
        if request.hash_block_size:
            check_block_size_compatible(self.block_size, request.hash_block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(self.hashes.setdefault(request.request_id, []), request, max_blocks, self.block_size)
        hits = 0
        cached = self.pool.cached
        while hits < max_blocks and hashes[hits] in cached:
            hits += 1
        tiers = self.tiers
        if tiers is not None:
            while hits < max_blocks and (hashes[hits] in cached or hashes[hits] in tiers):
                hits += 1
        return hits * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> bool:
        seq = request.request_id
        table = self.tables.get(seq)
        if num_new_tokens == 1 and table is not None and not num_hit_tokens:
            # The hot path: one decode token landing inside an unshared block that it does not
            # fill, with every earlier full block already offered to the cache (not so right after
            # a swap-in), changes nothing: nothing to allocate, copy or register.
            pos = request.num_computed_tokens
            bs = self.block_size
            registered = not self.enable_caching or ((pos + 1) % bs and self.num_registered[seq] == pos // bs)
            if pos % bs and registered and self.pool.ref_cnt[table[pos // bs]] == 1:
                return True
        if self.blocks_needed(request, num_new_tokens, num_hit_tokens) > self.pool.num_free:
            return False
        if table is None:
            table = self.tables[seq] = []
            self.num_registered[seq] = 0
            if request.num_preemptions == 0:  # as vLLM's hit rate: re-admissions are not queries
                self.prefix_query_tokens += request.num_tokens
                self.prefix_hit_tokens += num_hit_tokens
            else:
                self.resume_hit_blocks += num_hit_tokens // self.block_size
        if num_hit_tokens:
            hit_blocks = self._hit_blocks(request, num_hit_tokens)
            for block in hit_blocks:
                if block is not None:
                    self.pool.touch(block)
            if self.tiers is not None and None in hit_blocks:
                self._promote(request, hit_blocks)
            table += hit_blocks
            self.num_table_blocks += num_hit_tokens // self.block_size
            self.num_registered[seq] = len(table)
        first_write = request.num_computed_tokens + num_hit_tokens
        if self._needs_copy(table, first_write):
            idx = first_write // self.block_size
            src, dst = table[idx], self.pool.allocate()
            self.pool.release(src)
            table[idx] = dst
            self._pending_copies.append((src, dst))
            self.num_copies += 1
        total = first_write + num_new_tokens
        growth = cdiv(total, self.block_size) - len(table)
        if growth > 0:
            table += self.pool.allocate_many(growth)
            self.num_table_blocks += growth
        if self.enable_caching:
            self._register_full_blocks(request, table, min(total, request.num_tokens) // self.block_size)
        return True

    def _promote(self, request: Request, hit_blocks: list[int | None]) -> None:
        """Fresh device blocks, indexed by their prefix, for the hit's blocks a tier holds (the
        Nones of ``hit_blocks``, filled in place); the device hits are referenced already, so the
        allocations cannot evict them, and the promoted prefixes leave their tiers first, so the
        demotions the allocations cause cannot push them further down."""
        hashes = self.hashes[request.request_id]
        missing = [j for j, block in enumerate(hit_blocks) if block is None]
        from_host, from_ssd, from_store = self.tiers.promote([hashes[j] for j in missing], request.arrival_s)
        if request.num_preemptions == 0:  # as the prefix hit rate: first admissions only
            self.tiers.stats.host_tokens += from_host * self.block_size
            self.tiers.stats.ssd_tokens += from_ssd * self.block_size
            self.tiers.stats.store_tokens += from_store * self.block_size
        for j in missing:
            block = self.pool.allocate()
            self.pool.cache(block, hashes[j])
            hit_blocks[j] = block

    def _register_full_blocks(self, request: Request, table: list[int], num_full: int) -> None:
        seq = request.request_id
        start = self.num_registered[seq]
        if num_full <= start:
            return
        hashes = extend_block_hashes(self.hashes.setdefault(seq, []), request, num_full, self.block_size)
        for j in range(start, num_full):
            self.pool.cache(table[j], hashes[j])
        if self.tiers is not None:
            self.tiers.computed(hashes[start:num_full])
        self.num_registered[seq] = num_full

    def _free_device(self, request: Request) -> None:
        seq = request.request_id
        table = self.tables.pop(seq, None)
        self.num_registered.pop(seq, None)
        self.hashes.pop(seq, None)
        self.forked.discard(seq)
        if table:
            self.num_table_blocks -= len(table)
            # Blocks are hashed when allocated, before the step computes them; a request freed
            # in between (preempted after its allocation this step) never wrote them.
            for block in table[request.num_computed_tokens // self.block_size :]:
                self.pool.uncache(block)
            self.pool.release_many(reversed(table))  # tail blocks first: they are evicted first

    def fork(self, parent: Request, child: Request) -> None:
        table = self.tables[parent.request_id]
        for block in table:
            self.pool.touch(block)
        self.tables[child.request_id] = list(table)
        self.num_table_blocks += len(table)
        self.forked.update((parent.request_id, child.request_id))
        self.hashes[child.request_id] = list(self.hashes.get(parent.request_id, []))
        self.num_registered[child.request_id] = self.num_registered[parent.request_id]

    def block_table(self, request: Request) -> list[int]:
        return self.tables.get(request.request_id, [])

    def _take_blocks_for_swap_in(self, request: Request, n: int) -> list[int] | None:
        if n > self.pool.num_free:
            return None
        table = self.tables[request.request_id] = self.pool.allocate_many(n)
        self.num_table_blocks += n
        self.num_registered[request.request_id] = 0
        return list(table)

    def decode_outlook(self, request: Request, num_steps: int) -> DecodeOutlook | None:
        if self._needs_copy(self.tables.get(request.request_id, []), request.num_computed_tokens):
            return None
        bs = self.block_size
        # A prefix cache registers a block the step that fills it (the one before it grows).
        bookkeeping = range((-request.num_computed_tokens - 1) % bs, num_steps, bs) if self.enable_caching else range(0)
        return DecodeOutlook(range(-request.num_computed_tokens % bs, num_steps, bs), bookkeeping)

    # --- observation ---------------------------------------------------------------------
    def pool_counts(self) -> tuple[int, int, int]:
        return self.pool.counts()

    def internal_waste(self, live: list[Request], computed_tokens: int | None = None) -> int:
        """Between steps every live table ends in the block of its last computed token, so
        without forks (a shared last block counts once) the waste is slots held minus tokens
        computed: one C-level sum instead of a walk over the tables."""
        if self.forked:
            return self._waste_by_last_block(live)
        if computed_tokens is None:
            computed_tokens = sum(map(_num_computed, live))
        return self.num_table_blocks * self.block_size - computed_tokens

    def _waste_by_last_block(self, live: list[Request]) -> int:
        """Internal waste at any moment, also mid-step (tables grown, tokens not yet computed)."""
        bs, tables = self.block_size, self.tables
        filled_in_last: dict[int, int] = {}  # a forked, shared last block counts once
        for req in live:
            table = tables.get(req.request_id)
            if table:
                filled = min(max(req.num_computed_tokens - (len(table) - 1) * bs, 0), bs)
                if filled > filled_in_last.get(table[-1], -1):
                    filled_in_last[table[-1]] = filled
        return bs * len(filled_in_last) - sum(filled_in_last.values())

    def stats(self, live: list[Request]) -> KVStats:
        used, cached, free = self.pool_counts()
        return KVStats(
            num_blocks=self.num_blocks,
            used=used,
            cached=cached,
            free=free,
            internal_waste_slots=self._waste_by_last_block(live),
            fragmentation=0.0,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            resume_hit_blocks=self.resume_hit_blocks,
            evictions=self.pool.evictions,
            copies=self.num_copies,
            swapped_out_blocks=self.swapped_out_blocks,
            swapped_in_blocks=self.swapped_in_blocks,
            host_blocks_used=self.host.num_blocks - self.host.num_free,
        )

    def check_invariants(self, live: list[Request]) -> None:
        holders = [0] * self.num_blocks
        for req in live:
            table = self.tables.get(req.request_id, [])
            assert len(set(table)) == len(table), f"request {req.request_id}: block table repeats a block"
            assert len(table) * self.block_size >= req.num_computed_tokens, (
                f"request {req.request_id}: table of {len(table)} blocks does not cover {req.num_computed_tokens} tokens"
            )
            for block in table:
                holders[block] += 1
        if self.tiers is not None:
            self.tiers.check(self.pool.cached.keys())
        assert set(self.tables) <= {r.request_id for r in live}, "a table belongs to no live request"
        assert self.num_table_blocks == sum(map(len, self.tables.values())), "table block count out of step"
        self.pool.check_invariants(holders)


@register_block_manager("prefix")
class PrefixCachingBlockManager(PagedBlockManager):
    enable_caching = True
