"""PlanTotals: the batch shape the engine accumulates while it fills a plan, and what reads it.

The engine's figures must equal :meth:`PlanTotals.of` (the reference walk over entries) on every
plan, and the cost model's features from totals must equal a direct walk over the entries, so
that reading totals instead of entries cannot move a prediction or a step record.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.policies.blocks import cdiv
from kvsim.policies.plan import PlanEntry, PlanTotals, StepPlan
from kvsim.sim.perf.cost_model import StepFeatures, features_from_plan


def walked_features(plan: StepPlan, block_size: int) -> StepFeatures:
    """The features by a plain walk over the entries (the cost model's definitions, restated)."""
    groups = {True: [e for e in plan.entries if e.is_prefill], False: [e for e in plan.entries if not e.is_prefill]}
    longest = {k: max((cdiv(e.end_position, block_size) for e in g), default=0) for k, g in groups.items()}
    widest = max((e.num_tokens for e in groups[True]), default=0)
    pre, dec = groups[True], groups[False]
    return StepFeatures(
        num_tokens=float(sum(e.num_tokens for e in plan.entries)),
        num_seqs=float(len(plan.entries)),
        num_sampled=float(sum(e.samples for e in plan.entries)),
        prefill_tokens=float(sum(e.num_tokens for e in pre)),
        attn_pairs=float(sum(e.num_tokens * e.first_position + e.num_tokens * (e.num_tokens + 1) // 2 for e in pre)),
        decode_seqs=float(len(dec)),
        decode_ctx_tokens=float(sum(e.end_position for e in dec)),
        prefill_ctx_tokens=float(sum(e.end_position for e in pre)),
        blocks_touched=float(sum(cdiv(e.end_position, block_size) for e in plan.entries)),
        copy_blocks=float(len(plan.copies)),
        swap_blocks=float(len(plan.swap_in) + len(plan.swap_out)),
        padded_attn_pairs=float(len(pre) * widest * longest[True] * block_size),
        padded_prefill_ctx_tokens=float(len(pre) * longest[True] * block_size),
        padded_decode_ctx_tokens=float(len(dec) * longest[False] * block_size),
        padded_blocks_touched=float(len(pre) * longest[True] + len(dec) * longest[False]),
        prefill_max_tokens=float(widest),
        decode_max_blocks=float(longest[False]),
        prefill_max_blocks=float(longest[True]),
    )


entry = st.builds(
    lambda i, first, n, prefill, samples: PlanEntry(f"r{i}", first, n if prefill else 1, prefill, samples),
    st.integers(0, 10**6), st.integers(0, 200_000), st.integers(1, 9000), st.booleans(), st.booleans(),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(entry, max_size=40), block_size=st.sampled_from([1, 16, 128]), copies=st.integers(0, 3),
       swaps=st.integers(0, 3), engine_filled=st.booleans())  # fmt: skip
def test_features_from_totals_equal_a_walk_over_the_entries(entries, block_size, copies, swaps, engine_filled) -> None:
    plan = StepPlan(step=0, entries=entries, copies=[(1, 2)] * copies, swap_out=[(3, 4)] * swaps)
    if engine_filled:
        plan.totals = PlanTotals.of(entries, block_size)
    assert dataclasses.astuple(features_from_plan(plan, block_size)) == dataclasses.astuple(walked_features(plan, block_size))
    assert plan.num_tokens == sum(e.num_tokens for e in entries)
    assert plan.num_prefill_tokens + plan.num_decode_tokens == plan.num_tokens


def test_totals_at_another_block_size_are_recomputed() -> None:
    entries = [PlanEntry("a", 15, 1, False, True), PlanEntry("b", 0, 40, True, True)]
    plan = StepPlan(step=0, entries=entries, totals=PlanTotals.of(entries, 16))
    assert plan.totals_for(16) is plan.totals
    assert plan.totals_for(8) == PlanTotals.of(entries, 8) and plan.totals_for(8).blocks_touched == 2 + 5


def test_kind_from_totals_and_from_entries_agree() -> None:
    cases = {
        "idle": [],
        "prefill": [PlanEntry("p", 0, 8, True, False)],
        "decode": [PlanEntry("d", 8, 1, False, True)],
        "mixed": [PlanEntry("p", 0, 8, True, True), PlanEntry("d", 8, 1, False, True)],
    }
    for kind, entries in cases.items():
        assert StepPlan(step=0, entries=entries).kind == kind
        assert StepPlan(step=0, entries=entries, totals=PlanTotals.of(entries, 4)).kind == kind


def test_the_engine_fills_totals_that_equal_the_reference_on_every_plan(make_driver) -> None:
    """Chunked prefills, one-token prompts, decodes, forks of parallel samples and recompute
    preemptions in one run; the driver's plan.check also compares the totals each step."""
    d = make_driver(max_num_batched_tokens=16, long_prefill_token_threshold=6, num_blocks=12)
    for i, (prompt, output, n) in enumerate([(30, 5, 1), (1, 4, 1), (9, 6, 2), (17, 8, 1), (5, 3, 3)]):
        d.engine.add_request(f"r{i}", 0.0, prompt, output, n_samples=n)
    plans = d.run()
    assert d.engine.counters.preemptions > 0 and any(p.forks for p in plans)
    assert {p.kind for p in plans} >= {"prefill", "decode", "mixed"}
    for plan in plans:
        assert plan.totals == PlanTotals.of(plan.entries, d.engine.kv.block_size)
        assert dataclasses.astuple(features_from_plan(plan, 4)) == dataclasses.astuple(walked_features(plan, 4))


def test_check_catches_totals_that_do_not_add_up(make_driver) -> None:
    d = make_driver()
    d.engine.add_request("r", 0.0, 10, 3)
    plan = d.engine.schedule(0.0)
    plan.totals.decode_ctx_tokens += 1
    with pytest.raises(AssertionError, match="totals"):
        plan.check(d.engine.kv.block_size)
