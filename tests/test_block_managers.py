"""Hypothesis stateful tests: every block manager against a naive reference model of its pool.

The models identify a block's content by the whole prompt prefix it ends (not a hash chain),
count references by scanning the tables, keep the unreferenced blocks in a plain list and find
contiguous regions by scanning an occupancy array. They predict exactly what the managers must
do, in vLLM V1's BlockPool order: unreferenced blocks queue least recently freed first (a
request's tail blocks ahead of its head blocks), allocation and eviction take from the head,
a prefix hit is capped at ``num_tokens - 1`` and only full blocks are cached. After every rule
each live request's block table, the pending copies and every KVStats field must match the
model, and the manager's own ``check_invariants`` must pass.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsim.policies.block_manager import BlockManager
from kvsim.policies.blocks import cdiv
from kvsim.policies.contiguous import ContiguousBlockManager
from kvsim.policies.paged import PagedBlockManager, PrefixCachingBlockManager
from kvsim.policies.request import Request

BS = 4
NUM_BLOCKS = 12
HOST_BLOCKS = 6
MAX_MODEL_LEN = 24  # a contiguous max-length region is 6 blocks: two fit the pool
TRACE_BLOCK = 8  # trace hashes over 8 tokens: two engine blocks per trace block
MAX_PROMPT, MAX_OUTPUT = 16, 8  # prompt + output <= MAX_MODEL_LEN

pick = st.integers(0, 1_000)


FAMILIES = 5


def make_request(seq: int, family: int, prompt: int, output: int) -> Request:
    """Families 0-1 carry token ids sharing their first 6 tokens; 2-3 carry trace hashes sharing
    their first trace block; 4 is unique to each request (it only applies pool pressure)."""
    if family in (2, 3):
        hashes = tuple(0 if b == 0 else 1000 * family + b for b in range(cdiv(prompt, TRACE_BLOCK)))
        return Request(str(seq), seq, 0.0, prompt, output, trace_hashes=hashes, hash_block_size=TRACE_BLOCK)
    salt = 100 * (family + 1) + (10_000 * seq if family == 4 else 0)
    tokens = tuple(i if i < 6 else salt + i for i in range(prompt))
    return Request(str(seq), seq, 0.0, prompt, output, token_ids=tokens)


def fork_of(parent: Request, seq: int) -> Request:
    """A parallel sample of ``parent``, forked when its prefill completes (as the engine does)."""
    child = Request(
        str(seq), seq, 0.0, parent.prompt_tokens, parent.output_tokens,
        token_ids=parent.token_ids, trace_hashes=parent.trace_hashes, hash_block_size=parent.hash_block_size,
        parent=parent, content_id=parent.content_id,
    )  # fmt: skip
    child.num_computed_tokens, child.num_output_tokens = parent.num_computed_tokens, parent.num_output_tokens
    return child


def content(r: Request, j: int) -> tuple:
    """What engine block ``j`` of ``r`` holds, named by everything up to its end."""
    start, end = j * BS, (j + 1) * BS
    if end <= r.prompt_tokens:
        if r.token_ids is not None:
            return ("tokens", r.token_ids[:end])
        return ("trace", r.trace_hashes[: start // TRACE_BLOCK + 1], start % TRACE_BLOCK // BS)
    return ("generated", r.request_id, j)  # holds sampled tokens: this sequence's own


class HostModel:
    def __init__(self) -> None:
        self.free = list(range(HOST_BLOCKS))  # lowest id first, freed ones at the back
        self.tables: dict[str, list[int]] = {}
        self.out = self.back = 0

    def take(self, seq: str, n: int) -> list[int]:
        self.tables[seq], self.free = self.free[:n], self.free[n:]
        self.out += n
        return self.tables[seq]

    def give_back(self, seq: str) -> list[int]:
        blocks = self.tables.pop(seq)
        self.free += blocks
        return blocks


class SwapModel:
    """Swap-out as every manager does it (``BlockManager.swap_out``): whole table to host, then free."""

    def swap_out(self, r: Request) -> list[tuple[int, int]] | None:
        table = self.table(r)
        if len(table) > len(self.host.free):
            return None
        host = self.host.take(r.request_id, len(table))
        self.free(r)
        return list(zip(table, host))


class PagedModel(SwapModel):
    """The paged pool, with prefix caching when ``caching``."""

    def __init__(self, caching: bool) -> None:
        self.caching = caching
        self.queue = list(range(NUM_BLOCKS))  # unreferenced blocks, next to be taken first
        self.cached: dict[tuple, int] = {}  # content -> the block caching it
        self.content_of: dict[int, tuple] = {}
        self.tables: dict[str, list[int]] = {}
        self.registered: dict[str, int] = {}  # leading blocks already offered to the cache
        self.host = HostModel()
        self.pending: list[tuple[int, int]] = []
        self.evictions = self.copies = self.queries = self.hits = 0

    def refs(self, block: int) -> int:
        return sum(t.count(block) for t in self.tables.values())

    def table(self, r: Request) -> list[int]:
        return self.tables.get(r.request_id, [])

    def lookup(self, r: Request) -> int:
        n = 0
        while self.caching and n < (r.num_tokens - 1) // BS and content(r, n) in self.cached:
            n += 1
        return n * BS

    def _take(self) -> int:
        block = self.queue.pop(0)
        if block in self.content_of:
            del self.cached[self.content_of.pop(block)]
            self.evictions += 1
        return block

    def _cow_index(self, r: Request, first: int) -> int | None:
        table, idx = self.table(r), first // BS
        return idx if first % BS and idx < len(table) and self.refs(table[idx]) > 1 else None

    def needed(self, r: Request, new: int, hit: int) -> int:
        hits = [self.cached[content(r, j)] for j in range(hit // BS)]
        first = r.num_computed_tokens + hit
        grow = cdiv(first + new, BS) - len(self.table(r)) - len(hits)
        return grow + (self._cow_index(r, first) is not None) + sum(b in self.queue for b in hits)

    def allocate(self, r: Request, new: int, hit: int) -> bool:
        if self.needed(r, new, hit) > len(self.queue):
            return False
        if r.request_id not in self.tables:
            self.tables[r.request_id], self.registered[r.request_id] = [], 0
            self.queries += r.num_tokens
            self.hits += hit
        table = self.tables[r.request_id]
        for j in range(hit // BS):
            block = self.cached[content(r, j)]
            if block in self.queue:
                self.queue.remove(block)
            table.append(block)
        if hit:
            self.registered[r.request_id] = len(table)
        first = r.num_computed_tokens + hit
        idx = self._cow_index(r, first)
        if idx is not None:
            src, table[idx] = table[idx], self._take()
            self.pending.append((src, table[idx]))
            self.copies += 1
        while len(table) < cdiv(first + new, BS):
            table.append(self._take())
        full = min(first + new, r.num_tokens) // BS
        for j in range(self.registered[r.request_id], full if self.caching else 0):
            if content(r, j) not in self.cached and table[j] not in self.content_of:
                self.cached[content(r, j)], self.content_of[table[j]] = table[j], content(r, j)
        self.registered[r.request_id] = max(self.registered[r.request_id], full)
        return True

    def free(self, r: Request) -> None:
        table = self.tables.pop(r.request_id)
        del self.registered[r.request_id]
        for block in table[r.num_computed_tokens // BS :]:  # allocated but never computed
            if block in self.content_of:
                del self.cached[self.content_of.pop(block)]
        for block in reversed(table):
            if self.refs(block) == 0:
                self.queue.append(block)

    def fork(self, parent: Request, child: Request) -> bool:
        self.tables[child.request_id] = list(self.tables[parent.request_id])
        self.registered[child.request_id] = self.registered[parent.request_id]
        return True

    def swap_in(self, r: Request) -> list[tuple[int, int]] | None:
        if len(self.host.tables[r.request_id]) > len(self.queue):
            return None
        device = [self._take() for _ in self.host.tables[r.request_id]]
        self.tables[r.request_id], self.registered[r.request_id] = device, 0
        host = self.host.give_back(r.request_id)
        self.host.back += len(host)
        return list(zip(host, device))

    def stats(self, live: list[Request]) -> dict:
        filled: dict[int, int] = {}
        for r in live:
            for j, block in enumerate(self.table(r)):
                filled[block] = max(filled.get(block, 0), min(max(r.num_computed_tokens - j * BS, 0), BS))
        cached = sum(b in self.content_of for b in self.queue)
        return dict(
            num_blocks=NUM_BLOCKS, used=NUM_BLOCKS - len(self.queue), cached=cached, free=len(self.queue) - cached,
            internal_waste_slots=sum(BS - f for f in filled.values()), fragmentation=0.0,
            prefix_query_tokens=self.queries, prefix_hit_tokens=self.hits, resume_hit_blocks=0, evictions=self.evictions,
            copies=self.copies, swapped_out_blocks=self.host.out, swapped_in_blocks=self.host.back,
            host_blocks_used=HOST_BLOCKS - len(self.host.free),
        )  # fmt: skip


class ContiguousModel(SwapModel):
    """One region per request, first fit over an occupancy array; nothing shared or cached."""

    def __init__(self, reserve: str) -> None:
        self.reserve = reserve
        self.owner: list[int | None] = [None] * NUM_BLOCKS
        self.regions: dict[str, tuple[int, int]] = {}
        self.used: dict[str, int] = {}
        self.host = HostModel()
        self.pending: list[tuple[int, int]] = []
        self.copies = self.queries = 0

    def size(self, r: Request) -> int:
        return cdiv(MAX_MODEL_LEN if self.reserve == "max_model_len" else r.max_kv_tokens, BS)

    def _claim(self, r: Request) -> int | None:
        n = self.size(r)
        for start in range(NUM_BLOCKS - n + 1):
            if all(o is None for o in self.owner[start : start + n]):
                self.owner[start : start + n] = [r.request_id] * n
                self.regions[r.request_id] = (start, n)
                return start
        return None

    def table(self, r: Request) -> list[int]:
        if r.request_id not in self.regions:
            return []
        return list(range(self.regions[r.request_id][0], self.regions[r.request_id][0] + self.used[r.request_id]))

    def lookup(self, r: Request) -> int:
        return 0

    def needed(self, r: Request, new: int, hit: int) -> int:
        return 0 if r.request_id in self.regions else self.size(r)

    def allocate(self, r: Request, new: int, hit: int) -> bool:
        if r.request_id not in self.regions:
            if self._claim(r) is None:
                return False
            self.used[r.request_id] = 0
            self.queries += r.num_tokens
        self.used[r.request_id] = max(self.used[r.request_id], cdiv(r.num_computed_tokens + new, BS))
        return True

    def free(self, r: Request) -> None:
        start, n = self.regions.pop(r.request_id)
        del self.used[r.request_id]
        self.owner[start : start + n] = [None] * n

    def fork(self, parent: Request, child: Request) -> bool:
        start = self._claim(child)
        if start is None:
            return False
        used = self.used[child.request_id] = self.used[parent.request_id]
        self.pending += [(self.regions[parent.request_id][0] + i, start + i) for i in range(used)]
        self.copies += used
        return True

    def swap_in(self, r: Request) -> list[tuple[int, int]] | None:
        start = self._claim(r)
        if start is None:
            return None
        host = self.host.give_back(r.request_id)
        self.used[r.request_id] = len(host)
        self.host.back += len(host)
        return list(zip(host, range(start, start + len(host))))

    def stats(self, live: list[Request]) -> dict:
        reserved = NUM_BLOCKS - self.owner.count(None)
        free = NUM_BLOCKS - reserved
        largest = run = 0
        for o in self.owner:
            run = run + 1 if o is None else 0
            largest = max(largest, run)
        return dict(
            num_blocks=NUM_BLOCKS, used=reserved, cached=0, free=free,
            internal_waste_slots=reserved * BS - sum(r.num_computed_tokens for r in live),
            fragmentation=(1.0 - largest / free) if free else 0.0,
            prefix_query_tokens=self.queries, prefix_hit_tokens=0, resume_hit_blocks=0, evictions=0, copies=self.copies,
            swapped_out_blocks=self.host.out, swapped_in_blocks=self.host.back,
            host_blocks_used=HOST_BLOCKS - len(self.host.free),
        )  # fmt: skip


class PoolMachine(RuleBasedStateMachine):
    """Random admit / append / fork / free / preempt / swap sequences; eviction happens under pressure."""

    def new_manager(self) -> BlockManager:
        raise NotImplementedError

    def new_model(self):
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.manager = self.new_manager()
        self.model = self.new_model()
        self.live: dict[str, Request] = {}  # holding device blocks
        self.swapped: dict[str, Request] = {}
        self.next_seq = 0

    def _new_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq

    def _chosen(self, table: dict[str, Request], index: int, want=lambda r: True) -> Request | None:
        candidates = [r for _, r in sorted(table.items()) if want(r)]
        return candidates[index % len(candidates)] if candidates else None

    def _allocate(self, r: Request, new: int, hit: int = 0) -> bool:
        """allocate_slots on both; the manager's blocks_needed must be what it then takes."""
        needed = self.model.needed(r, new, hit)
        assert self.manager.blocks_needed(r, new, hit) == max(needed, 0)
        before = self.manager.num_available_blocks()
        ok = self.manager.allocate_slots(r, new, hit)
        assert ok == self.model.allocate(r, new, hit)
        if ok and isinstance(self.manager, PagedBlockManager):
            assert before - self.manager.num_available_blocks() == needed
        return ok

    @staticmethod
    def _computed(r: Request, new: int) -> None:
        r.num_computed_tokens += new
        if r.num_computed_tokens == r.num_tokens:
            r.num_output_tokens += 1  # the step samples a token

    @rule(family=st.integers(0, FAMILIES - 1), prompt=st.integers(1, MAX_PROMPT), output=st.integers(1, MAX_OUTPUT),
          chunk=st.integers(1, MAX_PROMPT))  # fmt: skip
    def admit(self, family: int, prompt: int, output: int, chunk: int) -> None:
        r = make_request(self._new_seq(), family, prompt, output)
        hit = self.manager.lookup(r)
        assert hit == self.model.lookup(r)
        new = min(chunk, r.num_tokens - hit)
        if self._allocate(r, new, hit):
            r.num_computed_tokens = hit
            self._computed(r, new)
            self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(index=pick, chunk=st.integers(1, MAX_PROMPT))
    def append(self, index: int, chunk: int) -> None:
        """The request's next prefill chunk, or its next decode token."""
        r = self._chosen(self.live, index, lambda r: r.remaining_output > 0)
        if r is not None:
            new = min(chunk, r.num_tokens - r.num_computed_tokens)
            if self._allocate(r, new):
                self._computed(r, new)

    @precondition(lambda self: self.live)
    @rule(index=pick, chunk=st.integers(1, MAX_PROMPT))
    def preempt_after_allocating(self, index: int, chunk: int) -> None:
        """A step allocates for the request, then preempts it before anything is computed."""
        r = self._chosen(self.live, index, lambda r: r.remaining_output > 0)
        if r is not None:
            self._allocate(r, min(chunk, r.num_tokens - r.num_computed_tokens))
            self.manager.free(r)
            self.model.free(r)
            del self.live[r.request_id]

    @precondition(lambda self: self.live)
    @rule(index=pick)
    def fork(self, index: int) -> None:
        parent = self._chosen(
            self.live, index, lambda r: r.parent is None and r.num_output_tokens == 1 and r.remaining_output > 0
        )
        if parent is not None:
            child = fork_of(parent, self._new_seq())
            self.manager.fork(parent, child)
            assert bool(self.manager.block_table(child)) == self.model.fork(parent, child)
            if self.manager.block_table(child):
                self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(index=pick)
    def free(self, index: int) -> None:
        r = self._chosen(self.live, index)
        self.manager.free(r)
        self.model.free(r)
        del self.live[r.request_id]

    @precondition(lambda self: self.live)
    @rule(index=pick)
    def swap_out(self, index: int) -> None:
        r = self._chosen(self.live, index)
        expected = self.model.swap_out(r)
        assert self.manager.swap_out(r) == expected  # None: no host room, nothing done
        if expected is not None:
            self.swapped[r.request_id] = self.live.pop(r.request_id)

    @precondition(lambda self: self.swapped)
    @rule(index=pick)
    def swap_in(self, index: int) -> None:
        r = self._chosen(self.swapped, index)
        assert self.manager.swap_in_blocks_needed(r) == len(self.model.host.tables[r.request_id])
        pairs = self.manager.swap_in(r)
        assert pairs == self.model.swap_in(r)
        if pairs is not None:
            self.live[r.request_id] = self.swapped.pop(r.request_id)

    @precondition(lambda self: self.swapped)
    @rule(index=pick)
    def free_swapped(self, index: int) -> None:
        """An aborted swapped request: ``free`` releases its host copy."""
        r = self._chosen(self.swapped, index)
        self.manager.free(r)
        self.model.host.give_back(r.request_id)
        del self.swapped[r.request_id]

    @invariant()
    def agrees_with_model(self) -> None:
        live = list(self.live.values())
        self.manager.check_invariants(live)
        for r in live:
            assert self.manager.block_table(r) == self.model.table(r), f"request {r.request_id}"
        if isinstance(self.manager, PagedBlockManager):
            assert self.manager.pool.ref_cnt == [self.model.refs(b) for b in range(NUM_BLOCKS)]
        assert self.manager.take_copies() == self.model.pending
        self.model.pending = []
        stats = self.manager.stats(live)
        assert stats.to_dict() == self.model.stats(live)
        assert stats.used + stats.cached + stats.free == NUM_BLOCKS
        assert self.manager.pool_counts() == (stats.used, stats.cached, stats.free)


MACHINE_SETTINGS = settings(max_examples=80, stateful_step_count=50, deadline=None)


class PagedMachine(PoolMachine):
    def new_manager(self) -> BlockManager:
        return PagedBlockManager(NUM_BLOCKS, BS, HOST_BLOCKS)

    def new_model(self) -> PagedModel:
        return PagedModel(caching=False)


class PrefixMachine(PoolMachine):
    def new_manager(self) -> BlockManager:
        return PrefixCachingBlockManager(NUM_BLOCKS, BS, HOST_BLOCKS)

    def new_model(self) -> PagedModel:
        return PagedModel(caching=True)


class ContiguousMaxLenMachine(PoolMachine):
    def new_manager(self) -> BlockManager:
        return ContiguousBlockManager(NUM_BLOCKS, BS, HOST_BLOCKS, max_model_len=MAX_MODEL_LEN)

    def new_model(self) -> ContiguousModel:
        return ContiguousModel("max_model_len")


class ContiguousOwnLengthMachine(PoolMachine):
    def new_manager(self) -> BlockManager:
        return ContiguousBlockManager(NUM_BLOCKS, BS, HOST_BLOCKS, max_model_len=MAX_MODEL_LEN, reserve="request")

    def new_model(self) -> ContiguousModel:
        return ContiguousModel("request")


TestPaged = PagedMachine.TestCase
TestPaged.settings = MACHINE_SETTINGS
TestPrefix = PrefixMachine.TestCase
TestPrefix.settings = MACHINE_SETTINGS
TestContiguousMaxLen = ContiguousMaxLenMachine.TestCase
TestContiguousMaxLen.settings = MACHINE_SETTINGS
TestContiguousOwnLength = ContiguousOwnLengthMachine.TestCase
TestContiguousOwnLength.settings = MACHINE_SETTINGS


def test_contiguous_regions_show_internal_waste_and_external_fragmentation():
    """Regions sized for the request (4, 2 and 4 blocks) fill a 10-block pool; freeing the
    first and last leaves 8 free blocks in two 4-block holes: half the free space is unusable
    by a 5-block region, which is refused although the pool has room for it in total."""
    kv = ContiguousBlockManager(10, BS, max_model_len=MAX_MODEL_LEN, reserve="request")
    a, b, c = Request("a", 1, 0.0, 16, 1), Request("b", 2, 0.0, 8, 1), Request("c", 3, 0.0, 16, 1)
    for r in (a, b, c):
        assert kv.allocate_slots(r, 5)
        r.num_computed_tokens = 5
    assert [kv.regions[r.request_id] for r in (a, b, c)] == [(0, 4), (4, 2), (6, 4)]
    stats = kv.stats([a, b, c])
    assert (stats.used, stats.free, stats.internal_waste_slots, stats.fragmentation) == (10, 0, 40 - 15, 0.0)

    kv.free(a)
    kv.free(c)
    stats = kv.stats([b])
    assert (stats.used, stats.free, stats.internal_waste_slots, stats.fragmentation) == (2, 8, 8 - 5, 0.5)
    assert not kv.allocate_slots(Request("d", 4, 0.0, 20, 1), 20)  # 5 blocks: no hole is that large
    assert kv.allocate_slots(Request("e", 5, 0.0, 16, 1), 16)  # 4 blocks: the first hole
    assert kv.regions["e"] == (0, 4)


def test_pool_bulk_operations_match_one_at_a_time():
    """allocate_many / release_many take and return the same blocks in the same order as single
    calls, leaving the same queue, ref counts and prefix index, with and without cached free blocks."""
    from kvsim.policies.block_pool import BlockPool

    def scenario(bulk: bool) -> tuple:
        pool = BlockPool(12)
        first = pool.allocate_many(5) if bulk else [pool.allocate() for _ in range(5)]
        for block, h in zip(first, (101, 102, 103)):
            pool.cache(block, h)
        if bulk:
            pool.release_many(reversed(first))
        else:
            for block in reversed(first):
                pool.release(block)
        taken = [pool.allocate_many(n) if bulk else [pool.allocate() for _ in range(n)] for n in (4, 6)]
        pool.check_invariants([1 if pool.ref_cnt[b] else 0 for b in range(12)])
        return taken, pool.free_blocks(), pool.ref_cnt, pool.cached, pool.evictions, pool.num_cached_free

    bulk, single = scenario(True), scenario(False)
    assert bulk == single
    assert bulk[4] > 0  # the second round evicted cached prefixes: the slow path ran too
