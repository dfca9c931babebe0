"""EngineCore: the step loop's contract, rejections, aborts, configuration errors, the
invariant checks themselves, and random workloads that must always drain."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.policies.plan import StepPlan
from kvsim.policies.registry import register_scheduler, resolve_block_manager, resolve_scheduler
from kvsim.policies.request import Status
from kvsim.policies.schedulers import FCFSPolicy
from kvsim.policies.trace_feed import drain
from kvsim.traces.schema import Trace

MANAGERS = ["paged", "prefix", "contiguous"]
SCHEDULERS = ["fcfs", "chunked", "priority", "sjf", "static"]


@pytest.mark.parametrize("manager", MANAGERS)
def test_a_request_prefills_in_one_step_then_decodes_a_token_a_step(make_driver, manager):
    """Prompt 10, output 3: the prefill samples the first token; two decodes sample the rest.
    The KV never holds the last sampled token: 12 tokens, three 4-token blocks."""
    d = make_driver(block_manager=manager)
    request = d.engine.add_request("r", 0.0, 10, 3)
    plans = d.run()

    assert [d.batch(p) for p in plans] == [[("r", 0, 10, "p")], [("r", 10, 1, "d")], [("r", 11, 1, "d")]]
    assert [p.block_tables for p in plans] == [{"r": [0, 1, 2]}] * 3
    assert [p.slot_mapping for p in plans] == [list(range(10)), [10], [11]]
    assert all(e.samples for p in plans for e in p.entries)
    assert (request.status, request.first_token_s, request.finish_s, request.num_output_tokens) == (
        Status.FINISHED, 1.0, 3.0, 3,
    )  # fmt: skip
    assert d.finished == ["r"] and d.engine.counters.finished == 1
    assert d.engine.kv_stats().used == 0


def test_a_prefill_chunk_that_does_not_finish_the_prompt_samples_nothing(make_driver):
    d = make_driver(max_num_batched_tokens=8)
    d.engine.add_request("r", 0.0, 20, 2)
    plans = d.run()
    assert [d.batch(p) for p in plans] == [
        [("r", 0, 8, "p")], [("r", 8, 8, "p")], [("r", 16, 4, "p")], [("r", 20, 1, "d")],
    ]  # fmt: skip
    assert [[e.samples for e in p.entries] for p in plans] == [[False], [False], [True], [True]]
    assert [p.kind for p in plans] == ["prefill", "prefill", "prefill", "decode"]


@pytest.mark.parametrize(
    ("overrides", "prompt", "output", "reason"),
    [
        ({}, 0, 4, "invalid_length"),
        ({}, 4, 0, "invalid_length"),
        ({}, 60, 5, "exceeds_max_model_len"),
        ({"num_blocks": 4}, 16, 2, "exceeds_kv_pool"),  # 17 tokens of KV, 16 slots
        ({"num_blocks": 10, "watermark": 0.2}, 30, 4, "exceeds_kv_pool"),  # 33 tokens, 8 blocks outside the watermark
        ({"scheduler_params": {"chunked_prefill": False}}, 30, 4, "exceeds_token_budget"),  # 33 > 32
        ({"scheduler_params": {"chunked_prefill": False}, "long_prefill_token_threshold": 8}, 8, 2,
         "exceeds_token_budget"),
        ({"block_manager": "contiguous", "max_model_len": 80}, 60, 10, "exceeds_kv_pool"),  # 80-token region > 64 slots
        ({"block_manager": "contiguous", "max_model_len": 52, "num_blocks": 13, "watermark": 0.1}, 28, 4,
         "exceeds_kv_pool"),  # a 13-block region, 12 blocks outside the watermark
    ],
)
def test_a_request_that_can_never_run_is_rejected_at_arrival_with_its_reason(
    make_driver, overrides, prompt, output, reason
):
    d = make_driver(**overrides)
    request = d.engine.add_request("x", 0.0, prompt, output)
    assert (request.status, request.reject_reason) == (Status.REJECTED, reason)
    assert d.engine.has_unfinished()  # until a plan has reported it
    plan = d.step()
    assert plan.rejected == [("x", reason)] and plan.kind == "idle"
    assert not d.engine.has_unfinished()
    assert d.engine.counters.rejected == 1


@pytest.mark.parametrize(
    ("overrides", "prompt", "output"),
    [
        ({"num_blocks": 10, "watermark": 0.2}, 29, 4),  # exactly 8 blocks
        ({"scheduler_params": {"chunked_prefill": False}}, 29, 4),  # exactly the 32-token budget
        ({}, 60, 4),  # exactly max_model_len
    ],
)
def test_a_request_exactly_at_a_limit_is_admitted(make_driver, overrides, prompt, output):
    d = make_driver(**overrides)
    d.engine.add_request("x", 0.0, prompt, output)
    d.run()
    assert d.finished == ["x"]


def test_more_samples_than_running_seats_is_rejected_at_arrival_and_blocks_no_one(make_driver):
    d = make_driver(max_num_seqs=2, scheduler="priority")
    d.engine.add_request("A", 0.0, 4, 2, priority=1)
    b = d.engine.add_request("B", 0.0, 4, 2, priority=0, n_samples=3)
    assert b.reject_reason == "exceeds_max_num_seqs"
    plan = d.step()
    assert plan.rejected == [("B", "exceeds_max_num_seqs")]
    assert d.batch(plan) == [("A", 0, 4, "p")]


def test_the_waiting_queue_cap_rejects_arrivals_beyond_it(make_driver):
    d = make_driver(max_waiting=2)
    for name in "ABC":
        d.engine.add_request(name, 0.0, 4, 2)
    assert d.engine.requests["C"].reject_reason == "queue_full"
    plan = d.step()
    assert plan.rejected == [("C", "queue_full")]
    assert d.batch(plan) == [("A", 0, 4, "p"), ("B", 0, 4, "p")]
    d.engine.add_request("D", 1.0, 4, 2)  # the queue emptied: room again
    d.run()
    assert sorted(d.finished) == ["A", "B", "D"]


def test_a_duplicate_request_id_or_token_ids_not_matching_the_prompt_are_errors(make_engine):
    engine = make_engine()
    engine.add_request("A", 0.0, 4, 2)
    with pytest.raises(ValueError, match="'A' is already"):
        engine.add_request("A", 1.0, 4, 2)
    with pytest.raises(ValueError, match="'B': 3 token ids for a 4-token prompt"):
        engine.add_request("B", 1.0, 4, 2, token_ids=(1, 2, 3))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_releases_a_request_wherever_it_is(make_driver, mode):
    d = make_driver(num_blocks=5, block_manager="paged", preemption_mode=mode, num_host_blocks=8)
    d.engine.add_request("A", 0.0, 8, 8)
    d.engine.add_request("B", 0.0, 4, 8)
    d.engine.add_request("C", 0.0, 4, 8)
    d.engine.add_request("W", 0.0, 16, 2)  # waits: no room
    d.step()
    plan = d.step()  # A grows into block 4; B cannot grow: C is preempted
    assert plan.preempted == [("C", mode)]
    assert d.engine.requests["C"].status is (Status.SWAPPED if mode == "swap" else Status.WAITING)

    for name in ("A", "C", "W"):
        assert d.engine.abort(name)
        assert d.engine.requests[name].status is Status.ABORTED
        d.engine.check_invariants()
    assert not d.engine.abort("A") and not d.engine.abort("nobody")
    stats = d.engine.kv_stats()
    assert (stats.used, stats.host_blocks_used) == (2, 0)  # only B's blocks remain
    d.run()
    assert d.finished == ["B"] and d.engine.counters.aborted == 3
    assert d.engine.kv_stats().used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("manager", MANAGERS)
def test_running_out_of_blocks_is_an_outcome_not_an_exception(make_driver, manager, mode):
    """Twelve requests that each fit alone but not together in an 8-block pool all finish."""
    d = make_driver(num_blocks=8, max_model_len=32, block_manager=manager, preemption_mode=mode, num_host_blocks=4)
    for i in range(12):
        d.engine.add_request(f"r{i}", i * 0.5, 6 + 3 * (i % 4), 4 + (i % 5), n_samples=1 + (i % 3 == 0))
    d.run()
    assert d.engine.counters.rejected == 0
    requests = d.engine.requests.values()
    assert all(r.status is Status.FINISHED and r.num_output_tokens == r.output_tokens for r in requests)
    if manager != "contiguous":  # a region reserved whole at admission never needs to grow
        assert d.engine.counters.preemptions > 0
    assert d.engine.kv_stats().used == 0 and d.engine.kv_stats().host_blocks_used == 0


def test_configuration_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"num_blocks must be positive.*watermark must be in \[0, 1\)"):
        EngineConfig(num_blocks=0, watermark=1.0)
    with pytest.raises(ValueError, match="preemption_mode must be"):
        EngineConfig(num_blocks=8, preemption_mode="drop")
    with pytest.raises(ValueError, match=r"unknown scheduler 'lifo'; registered: chunked, fcfs, priority, sjf, static"):
        EngineCore(EngineConfig(num_blocks=8, scheduler="lifo"))
    with pytest.raises(ValueError, match=r"scheduler 'sjf' does not take parameter\(s\) \['aging'\]"):
        EngineCore(EngineConfig(num_blocks=8, scheduler="sjf", scheduler_params={"aging": 1.0}))
    with pytest.raises(ValueError, match=r"cannot load block manager 'no_such_module:Pool'"):
        EngineCore(EngineConfig(num_blocks=8, block_manager="no_such_module:Pool"))
    with pytest.raises(ValueError, match="reserve must be"):
        EngineCore(EngineConfig(num_blocks=8, block_manager="contiguous", block_manager_params={"reserve": "all"}))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        EngineCore(EngineConfig(num_blocks=8, scheduler="static", scheduler_params={"batch_size": 0}))


def test_policies_resolve_by_registered_name_or_module_path():
    assert resolve_scheduler("fcfs") is FCFSPolicy
    assert resolve_scheduler("kvsim.policies.schedulers:FCFSPolicy") is FCFSPolicy
    assert resolve_block_manager("prefix").__name__ == "PrefixCachingBlockManager"
    with pytest.raises(ValueError, match="'fcfs' is already registered by FCFSPolicy"):
        register_scheduler("fcfs")(type("Other", (FCFSPolicy,), {}))


def test_the_invariant_checks_catch_corrupted_bookkeeping(make_driver):
    d = make_driver(block_manager="paged")
    d.engine.add_request("A", 0.0, 8, 4)
    plan = d.step()
    d.engine.kv.pool.ref_cnt[0] += 1
    with pytest.raises(AssertionError, match="ref counts differ"):
        d.engine.check_invariants()
    d.engine.kv.pool.ref_cnt[0] -= 1

    bad = StepPlan.from_dict(plan.to_dict())
    bad.slot_mapping[1] = bad.slot_mapping[0]
    with pytest.raises(AssertionError, match="two tokens write the same slot"):
        bad.check(4)
    bad = StepPlan.from_dict(plan.to_dict())
    bad.block_tables["A"] = [1, 0]
    with pytest.raises(AssertionError, match="A position 0 has the wrong slot"):
        bad.check(4)

    d.engine.requests["A"].num_computed_tokens = 9  # more than its two blocks hold
    with pytest.raises(AssertionError, match="does not cover"):
        d.engine.check_invariants()


def test_a_plan_round_trips_through_its_decision_log_line(make_driver):
    d = make_driver(num_blocks=5, block_manager="paged", preemption_mode="swap", num_host_blocks=8)
    for name, prompt in (("A", 8), ("B", 4), ("C", 4)):
        d.engine.add_request(name, 0.0, prompt, 8, n_samples=2 if name == "A" else 1)
    d.engine.add_request("X", 0.0, 0, 1)
    d.run()
    assert any(p.swap_out for p in d.plans) and any(p.forks for p in d.plans) and any(p.rejected for p in d.plans)
    for plan in d.plans:
        assert StepPlan.from_dict(plan.to_dict()).to_json() == plan.to_json()


def _workload_log(scheduler: str, manager: str, mode: str) -> str:
    engine = EngineCore(
        EngineConfig(num_blocks=12, block_size=4, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=16,
                     scheduler=scheduler, block_manager=manager, preemption_mode=mode, num_host_blocks=6)
    )  # fmt: skip
    rng = np.random.default_rng(7)
    steps, arrivals = 0, sorted(rng.uniform(0, 20, 25))
    log = []
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0] <= steps:
            i, prompt, family = 25 - len(arrivals), int(rng.integers(1, 30)), int(rng.integers(0, 3))
            engine.add_request(f"r{i}", arrivals.pop(0), prompt, int(rng.integers(1, 12)),
                               priority=int(rng.integers(0, 3)), n_samples=int(rng.integers(1, 3)),
                               token_ids=tuple(range(family, family + prompt)))  # fmt: skip
        plan = engine.schedule(float(steps))
        steps += 1
        engine.commit(plan, float(steps))
        log.append(plan.to_json())
    return "\n".join(log)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_same_inputs_give_a_byte_identical_decision_log(scheduler):
    logs = {(m, mode): _workload_log(scheduler, m, mode) for m in MANAGERS for mode in ("recompute", "swap")}
    for (manager, mode), log in logs.items():
        assert _workload_log(scheduler, manager, mode) == log
    assert len(set(logs.values())) > 1  # the log records decisions: different pools decide differently


def test_drain_replays_a_trace_with_a_fixed_step_time(make_engine):
    trace = Trace(arrival_s=np.array([0.0, 0.0, 2.5, 100.0]), prompt_tokens=np.array([6, 3, 9, 5]),
                  output_tokens=np.array([3, 2, 1, 2]), priority=np.array([0, 1, 0, 0]))  # fmt: skip
    engine = make_engine()
    steps = drain(engine, trace, step_time_s=1.0, check=True)
    first = {r.request_id: r.first_token_s for r in engine.requests.values()}
    finish = {r.request_id: r.finish_s for r in engine.requests.values()}
    assert steps == 3 + 1 + 2  # 0-2 hold 0 and 1; 2.5 arrives before step 3; the engine idles until 100
    assert first == {"0": 1.0, "1": 1.0, "2": 4.0, "3": 101.0}
    assert finish == {"0": 3.0, "1": 2.0, "2": 4.0, "3": 102.0}
    assert engine.requests["1"].priority == 1


request_spec = st.tuples(
    st.integers(0, 12),  # arrival step
    st.integers(1, 40),  # prompt
    st.integers(1, 12),  # output
    st.integers(0, 2),  # priority
    st.integers(1, 3),  # parallel samples
    st.integers(0, 3),  # prompt family (shared token-id prefixes)
)
engine_spec = st.fixed_dictionaries(
    {
        "scheduler": st.sampled_from(SCHEDULERS),
        "block_manager": st.sampled_from(MANAGERS),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "num_blocks": st.integers(6, 24),
        "num_host_blocks": st.integers(0, 12),
        "max_num_batched_tokens": st.sampled_from([8, 16, 64]),
        "max_num_seqs": st.integers(1, 6),
        "watermark": st.sampled_from([0.0, 0.1]),
        "max_waiting": st.sampled_from([0, 4]),
        "long_prefill_token_threshold": st.sampled_from([0, 6]),
    }
)


# make_driver is a stateless factory: sharing it across examples is safe.
@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
@given(engine_spec, st.lists(request_spec, min_size=1, max_size=14))
def test_any_workload_drains_with_every_invariant_holding(make_driver, config, requests):
    """Whatever the policies, pool and arrivals: every step keeps the invariants, every request
    ends finished (with exactly its output length) or rejected at arrival (what can never run
    is known then), and no block stays used."""
    d = make_driver(max_model_len=52, **config)
    pending = sorted(enumerate(requests), key=lambda item: item[1][0])
    while pending or d.engine.has_unfinished():
        while pending and pending[0][1][0] <= d.now:
            i, (_, prompt, output, priority, n, family) = pending.pop(0)
            d.engine.add_request(f"r{i}", d.now, prompt, output, priority=priority, n_samples=n,
                                 token_ids=tuple(range(family, family + prompt)))  # fmt: skip
        d.step()
        assert len(d.plans) < 3_000, "no progress"
    for r in d.engine.requests.values():
        assert r.status in (Status.FINISHED, Status.REJECTED), r
        assert r.reject_reason != "unschedulable", r
        if r.status is Status.FINISHED:
            assert r.num_output_tokens == r.output_tokens
    assert d.engine.counters.finished + d.engine.counters.rejected == len(d.engine.requests)
    stats = d.engine.kv_stats()
    assert (stats.used, stats.host_blocks_used) == (0, 0)


def test_the_pool_check_catches_a_corrupted_free_queue_or_prefix_index():
    """Each fault the block pool's array check is there for, planted in a pool it passes."""
    from kvsim.policies.block_pool import BlockPool

    def pool_with_a_cached_free_block() -> tuple[BlockPool, list[int]]:
        pool = BlockPool(6)
        held = pool.allocate_many(3)
        pool.cache(held[0], 111)
        pool.cache(held[1], 222)
        pool.release(held[0])  # free, still holding prefix 111
        holders = [1 if b in held[1:] else 0 for b in range(6)]
        pool.check_invariants(holders)
        return pool, holders

    pool, holders = pool_with_a_cached_free_block()
    pool.ref_cnt[5] = 1  # referenced but still in the free queue
    holders[5] = 1
    with pytest.raises(AssertionError, match="free queue's count is off|differs from the unreferenced"):
        pool.check_invariants(holders)
    pool, holders = pool_with_a_cached_free_block()
    pool._queue.append(pool._queue[-1])  # a block queued twice
    pool._stamp[pool._queue[-1]] = pool._base + len(pool._queue) - 1
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_invariants(holders)
    pool, holders = pool_with_a_cached_free_block()
    pool.cached[111] = 2  # the index points at a block holding another prefix
    with pytest.raises(AssertionError, match="cache index entry for block 2 disagrees with its hash"):
        pool.check_invariants(holders)
    pool, holders = pool_with_a_cached_free_block()
    pool.num_cached_free += 1
    with pytest.raises(AssertionError):
        pool.check_invariants(holders)

