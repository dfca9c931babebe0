"""EngineCore.plan_tables / plan_slots: plans without block tables or slots decide exactly the same.

A simulation whose timer is the cost model and that keeps no decision log reads neither a
plan's block tables nor its slot mapping nor the entries of its persistent decode batch, so the
engine skips them (``batch_decodes`` counts the left-out decodes); everything else in the plan,
its totals, and so every duration and latency, must stay the same. A reader turns them back on.
A decision log reads the tables but derives the slots, so for it the engine leaves the slots
out and the plan derives them on demand (``all_slots``, ``to_json``).
"""

from __future__ import annotations

from kvsim import traces
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.perf.step_timer import ReplayTimer
from kvsim.sim.run.config import RunConfig, resolve
from kvsim.sim.run.decisions import DecisionLog
from kvsim.sim.run.simulator import SimOptions, simulate


def _step_all(engine, workload) -> list:
    for i, (prompt, output, n) in enumerate(workload):
        engine.add_request(f"r{i}", 0.0, prompt, output, n_samples=n)
    plans, now = [], 0.0
    while engine.has_unfinished():
        plan = engine.schedule(now)
        now += 1.0
        engine.commit(plan, now)
        plans.append(plan)
    return plans


def test_plans_without_tables_keep_every_decision(make_engine) -> None:
    workload = [(30, 5, 1), (1, 4, 1), (9, 6, 2), (17, 8, 1), (5, 3, 3)]  # chunks, forks and preemption
    geometry = dict(max_num_batched_tokens=16, long_prefill_token_threshold=6, num_blocks=12)
    with_tables = _step_all(make_engine(**geometry), workload)
    bare_engine = make_engine(**geometry)
    bare_engine.plan_tables = False
    bare = _step_all(bare_engine, workload)
    assert any(p.preempted for p in with_tables) and any(p.forks for p in with_tables)
    assert len(bare) == len(with_tables)
    for a, b in zip(with_tables, bare):
        assert (b.block_tables, b.slot_mapping) == ({}, [])
        assert a.block_tables and len(a.slot_mapping) == a.num_tokens or not a.entries
        assert (a.copies, a.swap_out, a.swap_in, a.preempted, a.rejected, a.forks) == (
            b.copies, b.swap_out, b.swap_in, b.preempted, b.rejected, b.forks,
        )  # fmt: skip
        # the bare plan's entries are the whole plan's, in order, less its batch's one-token decodes
        left_out = [e for e in a.entries if e not in b.entries]
        assert [e for e in a.entries if e in b.entries] == b.entries
        assert len(left_out) == b.batch_decodes and all(e.num_tokens == 1 and not e.is_prefill for e in left_out)
        assert a.batch_decodes == 0 and a.totals == b.totals and a.num_seqs == b.num_seqs == len(a.entries)
    assert sum(p.batch_decodes for p in bare) > 0, "the workload must exercise the decode batch"


def test_plans_without_slots_derive_the_same_ones(make_engine) -> None:
    workload = [(30, 5, 1), (1, 4, 1), (9, 6, 2), (17, 8, 1), (5, 3, 3)]
    geometry = dict(max_num_batched_tokens=16, long_prefill_token_threshold=6, num_blocks=12)
    whole = _step_all(make_engine(**geometry), workload)
    slotless_engine = make_engine(**geometry)
    slotless_engine.plan_slots = False
    slotless = _step_all(slotless_engine, workload)
    assert len(whole) == len(slotless) and any(p.entries for p in slotless)
    for a, b in zip(whole, slotless):
        assert not a.slots_omitted and b.slots_omitted and b.slot_mapping == []
        assert (a.entries, a.block_tables) == (b.entries, b.block_tables)
        assert b.all_slots() == a.slot_mapping
        b.check(b.totals.block_size)  # --check's plan checks read the derived slots
        assert b.to_json() == a.to_json()


def test_a_simulation_copies_tables_only_for_a_reader() -> None:
    trace = traces.first(traces.load_named("demo"), 40)
    resolved = resolve(RunConfig())

    def run(timer, **options):
        engine = resolved.new_engine()
        return engine, simulate(trace, engine, timer, SimOptions(**options))

    bare_engine, bare = run(CostModelTimer(resolved.cost_model()))
    checked_engine, checked = run(CostModelTimer(resolved.cost_model()), check=True)  # plan.check reads the slots
    assert not bare_engine.plan_tables and checked_engine.plan_tables and checked_engine.plan_slots
    logged_engine, logged = run(CostModelTimer(resolved.cost_model()), decisions=DecisionLog("summary", resolved.engine_config.block_size))
    # the log keeps the batch itself: it reads what changed, and derives the slots
    assert logged_engine.plan_changes and not logged_engine.plan_tables and not logged_engine.plan_slots
    assert logged.steps.columns == checked.steps.columns
    assert bare.steps.columns == checked.steps.columns
    assert bare.request_rows() == checked.request_rows()
    replay_engine, _ = run(ReplayTimer([0.01] * 10_000))  # a timer that does not say it reads no tables
    assert replay_engine.plan_tables
