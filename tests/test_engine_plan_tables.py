"""PlanDetail: plans that spell out less (no block tables, no slots) decide exactly the same.

A simulation whose timer is the cost model and that keeps no decision log reads neither a
plan's block tables nor its slot mapping nor the entries of its persistent decode batch, so the
engine leaves them out (``PlanDetail.TOTALS``: ``StepPlan.batch`` counts the left-out decodes);
everything else in the plan, its totals, and so every duration and latency, must stay the same.
A decision log reads the tables but derives the slots (``PlanDetail.TABLES``): the plan derives
them on demand (``all_slots``, ``to_json``).
"""

from __future__ import annotations

from kvsim import traces
from kvsim.policies.plan import BatchDecodes, PlanDetail
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.perf.step_timer import ReplayTimer
from kvsim.sim.run.config import RunConfig, resolve
from kvsim.sim.run.decisions import DecisionLog
from kvsim.sim.run.simulator import SimOptions, Simulation

WORKLOAD = [(30, 5, 1), (1, 4, 1), (9, 6, 2), (17, 8, 1), (5, 3, 3)]  # chunks, forks and preemption
GEOMETRY = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 6, "num_blocks": 12}


def test_plans_without_tables_keep_every_decision(make_engine, step_all) -> None:
    with_tables = step_all(make_engine(**GEOMETRY), WORKLOAD, PlanDetail.SLOTS)
    bare = step_all(make_engine(**GEOMETRY), WORKLOAD, PlanDetail.TOTALS)
    assert any(p.preempted for p in with_tables) and any(p.forks for p in with_tables)
    assert len(bare) == len(with_tables)
    for a, b in zip(with_tables, bare):
        assert (b.block_tables, b.slot_mapping) == ({}, None) and type(b.batch) is BatchDecodes
        assert a.block_tables and len(a.slot_mapping) == a.num_tokens or not a.entries
        assert (a.copies, a.swap_out, a.swap_in, a.preempted, a.rejected, a.forks) == (
            b.copies, b.swap_out, b.swap_in, b.preempted, b.rejected, b.forks,
        )  # fmt: skip
        # the bare plan's entries are the whole plan's, in order, less its batch's one-token decodes
        left_out = [e for e in a.entries if e not in b.entries]
        assert [e for e in a.entries if e in b.entries] == b.entries
        assert len(left_out) == b.batch_decodes and all(e.num_tokens == 1 and not e.is_prefill for e in left_out)
        assert a.batch is None and a.totals == b.totals and a.num_seqs == b.num_seqs == len(a.entries)
    assert sum(p.batch_decodes for p in bare) > 0, "the workload must exercise the decode batch"


def test_plans_without_slots_derive_the_same_ones(make_engine, step_all) -> None:
    whole = step_all(make_engine(**GEOMETRY), WORKLOAD, PlanDetail.SLOTS)
    slotless = step_all(make_engine(**GEOMETRY), WORKLOAD, PlanDetail.TABLES)
    assert len(whole) == len(slotless) and any(p.entries for p in slotless)
    for a, b in zip(whole, slotless):
        assert a.slot_mapping is not None and b.slot_mapping is None
        assert (a.entries, a.block_tables) == (b.entries, b.block_tables)
        assert b.all_slots() == a.slot_mapping
        b.check(b.totals.block_size)  # --check's plan checks read the derived slots
        assert b.to_json() == a.to_json()


def test_a_simulation_asks_for_what_its_readers_read() -> None:
    trace = traces.first(traces.load_named("demo"), 40)
    resolved = resolve(RunConfig())

    def run(timer, **options) -> Simulation:
        simulation = Simulation(trace, resolved.new_engine(), timer, SimOptions(**options))
        simulation.result = simulation.run()
        return simulation

    bare = run(CostModelTimer(resolved.cost_model()))
    checked = run(CostModelTimer(resolved.cost_model()), check=True)  # plan.check reads the slots
    assert (bare.plan_detail, checked.plan_detail) == (PlanDetail.TOTALS, PlanDetail.SLOTS)
    logged = run(CostModelTimer(resolved.cost_model()), decisions=DecisionLog("summary", resolved.engine_config.block_size))
    assert logged.plan_detail is PlanDetail.CHANGES  # the log keeps the batch itself: it reads what changed
    assert logged.steps.columns == checked.steps.columns
    assert bare.steps.columns == checked.steps.columns
    assert bare.result.request_rows() == checked.result.request_rows()
    assert run(ReplayTimer([0.01] * 10_000)).plan_detail is PlanDetail.SLOTS  # a replay compares whole plans
