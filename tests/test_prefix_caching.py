"""Automatic prefix caching, pinned on small hand-built scenarios with exact block ids.

Block ids follow vLLM V1's BlockPool: a fresh pool hands out blocks 0, 1, 2, ... in order;
a freed request's blocks join the back of the unreferenced queue tail block first; new
blocks (and evictions of cached ones) come from the front of that queue.
"""

from __future__ import annotations

import pytest

from kvsim.policies.paged import PrefixCachingBlockManager
from kvsim.policies.request import Request

T = tuple(range(100, 200))  # a prompt's token ids; requests sharing a prefix of T share blocks


def unique_tokens(seed: int, n: int) -> tuple[int, ...]:
    return tuple(10_000 * seed + i for i in range(n))


def test_a_new_request_reuses_every_leading_cached_block_without_copying(make_driver):
    d = make_driver()
    d.engine.add_request("A", 0.0, 10, 4, token_ids=T[:10])
    d.step()
    d.engine.add_request("B", 1.0, 10, 4, token_ids=T[:8] + (900, 901))
    plan = d.step()

    assert d.batch(plan) == [("A", 10, 1, "d"), ("B", 8, 2, "p")]  # B starts after its 8 cached tokens
    assert plan.block_tables == {"A": [0, 1, 2], "B": [0, 1, 3]}
    assert plan.slot_mapping == [10, 12, 13]
    assert plan.copies == []
    assert [d.engine.kv.pool.ref_cnt[b] for b in range(4)] == [2, 2, 1, 1]
    assert d.engine.requests["B"].prefix_hit_tokens == 8
    stats = d.engine.kv_stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.used, stats.copies) == (20, 8, 4, 0)
    assert stats.internal_waste_slots == 1 + 2  # A holds 3 tokens of block 2, B 2 of block 3
    d.run()
    assert d.engine.kv_stats().used == 0


def test_a_hit_leaves_the_last_prompt_token_to_compute():
    """An identical 8-token prompt (two full blocks) hits one block: the last token is always
    recomputed (vLLM caps a hit at num_tokens - 1), which here recomputes the whole block."""
    kv = PrefixCachingBlockManager(num_blocks=16, block_size=4)
    a = Request("A", 1, 0.0, 8, 1, token_ids=T[:8])
    assert kv.lookup(a) == 0 and kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.free(a)
    assert kv.stats([]).cached == 2

    b = Request("B", 2, 0.0, 8, 1, token_ids=T[:8])
    assert kv.lookup(b) == 4
    assert kv.allocate_slots(b, 4, num_hit_tokens=4)
    assert kv.block_table(b) == [0, 2]  # block 1 holds the same tokens but is not hit; 2 is fresh
    stats = kv.stats([b])
    assert (stats.used, stats.cached, stats.prefix_hit_tokens, stats.prefix_query_tokens) == (2, 1, 4, 16)


def test_unreferenced_blocks_stay_cached_and_the_chain_tail_is_evicted_first(make_driver):
    d = make_driver(num_blocks=6)
    d.engine.add_request("A", 0.0, 12, 1, token_ids=T[:12])  # blocks 0, 1, 2; all full, all cached
    d.run()
    stats = d.engine.kv_stats()
    assert (stats.used, stats.cached, stats.free) == (0, 3, 3)

    d.engine.add_request("F", d.now, 16, 1, token_ids=unique_tokens(1, 16))  # four blocks: 3, 4, 5, then 2
    (plan,) = d.run()
    assert plan.block_tables["F"] == [3, 4, 5, 2]
    stats = d.engine.kv_stats()
    assert (stats.evictions, stats.cached, stats.free) == (1, 6, 0)

    d.engine.add_request("C", d.now, 12, 1, token_ids=T[:12])
    (plan,) = d.run()
    assert d.batch(plan) == [("C", 8, 4, "p")]  # A's first two blocks survived the eviction
    assert plan.block_tables["C"] == [0, 1, 2]  # block 2 (F's last, LRU head after 1 and 0) is evicted again


def test_a_fork_shares_all_blocks_and_copies_the_shared_partial_block_before_writing(make_driver):
    d = make_driver()
    d.engine.add_request("R", 0.0, 6, 3, n_samples=3, token_ids=T[:6])
    plan = d.step()
    assert d.batch(plan) == [("R", 0, 6, "p")]
    assert plan.forks == [("R", ["R#1", "R#2"])]
    assert [r.request_id for r in d.engine.running] == ["R", "R#1", "R#2"]
    assert d.engine.kv.pool.ref_cnt[:2] == [3, 3]

    plan = d.step()  # each sample writes position 6, inside shared block 1
    assert d.batch(plan) == [("R", 6, 1, "d"), ("R#1", 6, 1, "d"), ("R#2", 6, 1, "d")]
    assert plan.copies == [(1, 2), (1, 3)]  # the last holder writes in place
    assert plan.block_tables == {"R": [0, 2], "R#1": [0, 3], "R#2": [0, 1]}
    assert plan.slot_mapping == [10, 14, 6]
    assert d.engine.kv.pool.ref_cnt[:4] == [3, 1, 1, 1]

    d.run()
    assert sorted(d.finished) == ["R", "R#1", "R#2"]
    assert d.engine.kv_stats().copies == 2


def _admit_whole(kv: PrefixCachingBlockManager, request: Request) -> int:
    hit = kv.lookup(request)
    assert kv.allocate_slots(request, request.num_tokens - hit, hit)
    request.num_computed_tokens = request.num_tokens
    return hit


@pytest.mark.parametrize(("block_size", "full_hit"), [(16, 1296), (128, 1280), (512, 1024)])
def test_trace_hashes_of_512_token_blocks_map_onto_any_engine_block_size_dividing_512(block_size, full_hit):
    """Engine block j inside trace block b is keyed by (hash b, sub-block index), chained.

    A 1300-token prompt is two full trace blocks and a 276-token partial one: a repeat hits
    the partial one's full engine sub-blocks too, up to the num_tokens - 1 cap.
    """
    kv = PrefixCachingBlockManager(num_blocks=100, block_size=block_size)
    _admit_whole(kv, Request("A", 1, 0.0, 1300, 1, trace_hashes=(7, 8, 9), hash_block_size=512))

    def hit(seq: int, prompt: int, hashes: tuple[int, ...]) -> int:
        return kv.lookup(Request(str(seq), seq, 0.0, prompt, 1, trace_hashes=hashes, hash_block_size=512))

    assert hit(2, 1300, (7, 8, 5)) == 1024  # the third trace block differs
    assert hit(3, 1000, (7, 9)) == 512
    assert hit(4, 1300, (6, 8, 9)) == 0  # same later hashes, different first block: nothing
    assert hit(5, 1300, (7, 8, 9)) == full_hit


def test_trace_hashes_map_onto_engine_blocks_that_are_multiples_of_the_trace_block():
    kv = PrefixCachingBlockManager(num_blocks=16, block_size=32)
    _admit_whole(kv, Request("A", 1, 0.0, 96, 1, trace_hashes=(1, 2, 3, 4, 5, 6), hash_block_size=16))
    probe = Request("B", 2, 0.0, 96, 1, trace_hashes=(1, 2, 3, 4, 5, 9), hash_block_size=16)
    assert kv.lookup(probe) == 64  # engine blocks 0 and 1 cover trace hashes (1, 2) and (3, 4)
    longer = Request("C", 3, 0.0, 128, 1, trace_hashes=(1, 2, 3, 4, 5, 6, 7, 8), hash_block_size=16)
    assert kv.lookup(longer) == 96


def test_an_engine_block_size_that_neither_divides_nor_is_a_multiple_of_the_trace_block_is_refused():
    kv = PrefixCachingBlockManager(num_blocks=16, block_size=96)
    with pytest.raises(ValueError, match=r"96.*512"):
        kv.lookup(Request("A", 1, 0.0, 1024, 1, trace_hashes=(1, 2), hash_block_size=512))


def test_a_request_arriving_while_its_prefix_is_still_being_prefilled_hits_only_the_allocated_part(make_driver):
    """A 64-token prompt prefilled 16 tokens a step: B, arriving during A's third chunk, finds
    the 12 blocks A has been given so far (a step's KV writes precede its attention, so
    blocks allocated in the same step count), 48 tokens; C, arriving once A's prefill is
    done, hits 60 (15 blocks: the cap leaves the last token to compute)."""
    d = make_driver(num_blocks=64, max_model_len=128, max_num_batched_tokens=20, long_prefill_token_threshold=16)
    d.engine.add_request("A", 0.0, 64, 2, token_ids=T[:64])
    d.step()
    d.step()
    d.engine.add_request("B", 1.5, 64, 2, token_ids=T[:64])
    assert d.batch(d.step()) == [("A", 32, 16, "p"), ("B", 48, 4, "p")]
    assert d.batch(d.step()) == [("A", 48, 16, "p"), ("B", 52, 4, "p")]
    d.engine.add_request("C", 3.5, 64, 2, token_ids=T[:64])
    assert d.batch(d.step()) == [("A", 64, 1, "d"), ("B", 56, 8, "p"), ("C", 60, 4, "p")]
    assert [d.engine.requests[r].prefix_hit_tokens for r in "ABC"] == [0, 48, 60]
    stats = d.engine.kv_stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (3 * 64, 48 + 60)


def test_a_victim_preempted_after_its_own_allocation_leaves_no_uncomputed_block_cached(make_driver):
    """Priority: B (worse priority, admitted first) gets its next 8-token chunk, then A cannot
    grow and the victim is B, already scheduled: the blocks hashed for B's chunk were never
    computed, so they must not be served to anyone (only B's 16 computed tokens are)."""
    d = make_driver(num_blocks=7, max_num_batched_tokens=16, long_prefill_token_threshold=8, scheduler="priority")
    d.engine.add_request("B", 0.0, 24, 2, priority=1, token_ids=T[:24])
    d.step()
    d.engine.add_request("A", 0.5, 4, 10, priority=0, token_ids=unique_tokens(1, 4))
    assert d.batch(d.step()) == [("B", 8, 8, "p"), ("A", 0, 4, "p")]
    plan = d.step()
    assert plan.preempted == [("B", "recompute")]
    assert d.batch(plan) == [("A", 4, 1, "d")]
    assert plan.block_tables == {"A": [4, 6]}  # B's tail block 6 went first; block 5 stays free
    assert d.engine.kv.lookup(Request("probe", 99, 0.0, 24, 1, token_ids=T[:24])) == 16
    stats = d.engine.kv_stats()
    assert (stats.used, stats.cached, stats.free) == (2, 4, 1)
    d.run()


def test_prefix_hits_count_first_admissions_and_resume_hits_apart(make_driver):
    """As vLLM's hit-rate metric: a recompute-preempted request's re-admission (which hits its
    own surviving blocks) is not a new query; the blocks it finds again are counted apart."""
    d = make_driver(num_blocks=4)
    d.engine.add_request("A", 0.0, 7, 6, token_ids=unique_tokens(1, 7))
    d.engine.add_request("B", 0.0, 7, 6, token_ids=unique_tokens(2, 7))
    d.step()
    d.step()
    plan = d.step()  # A needs a third block: B, the latest admitted, is preempted
    assert plan.preempted == [("B", "recompute")]
    plans = d.run()
    resumed = next(p for p in plans if any(e.request_id == "B" for e in p.entries))
    assert d.batch(resumed) == [("B", 4, 5, "p")]  # its prompt's first block survived: prompt + 2 sampled - 4
    assert d.engine.requests["B"].prefix_hit_tokens == 0
    stats = d.engine.kv_stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (14, 0)
    assert stats.resume_hit_blocks == 1  # counted apart: B's surviving block


def test_a_waiting_request_aborted_after_prefix_lookups_leaves_no_hash_list_behind(make_driver):
    """Lookups hash a waiting request's prompt each step it is considered; aborting it must drop that state."""
    d = make_driver(num_blocks=20, max_model_len=128, max_num_batched_tokens=128)
    d.engine.add_request("A", 0.0, 64, 8, token_ids=T[:64])
    d.step()
    d.engine.add_request("B", 0.5, 64, 8, token_ids=unique_tokens(7, 64))
    assert d.batch(d.step()) == [("A", 64, 1, "d")]  # B does not fit beside A: it waits
    kv, b = d.engine.kv, d.engine.requests["B"]
    assert b.request_id in kv.hashes
    assert d.engine.abort("B")
    assert b.request_id not in kv.hashes and d.engine.requests["A"].request_id in kv.hashes
