"""Scheduling policies, pinned on hand-built scenarios with exact plans.

Unless a test says otherwise: 4-token blocks, a 32-token budget per step, the ``paged``
manager (no prefix hits to blur the arithmetic) and one step per time unit. Block ids follow
the free queue: a fresh pool hands out 0, 1, 2, ...; freed blocks rejoin at its back, a
request's tail block first.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.policies.request import Status
from kvsim.policies.schedulers import FCFSPolicy

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def add_all(engine, *requests) -> None:
    """``(id, arrival, prompt, output, extra kwargs...)`` tuples."""
    for rid, arrival, prompt, output, *extra in requests:
        engine.add_request(rid, arrival, prompt, output, **(extra[0] if extra else {}))


def admitted_steps(engine) -> dict[str, int]:
    return {r.request_id: r.admitted_step for r in engine.requests.values()}


def test_fcfs_serves_running_requests_first_then_admits_waiting_ones_under_one_token_budget(make_driver):
    d = make_driver(num_blocks=32, block_manager="paged")
    add_all(d.engine, ("A", 0.0, 20, 4), ("B", 0.0, 20, 4), ("C", 0.0, 20, 4))
    assert d.batch(d.step()) == [("A", 0, 20, "p"), ("B", 0, 12, "p")]  # B gets the budget's last 12 tokens
    assert d.batch(d.step()) == [("A", 20, 1, "d"), ("B", 12, 8, "p"), ("C", 0, 20, "p")]
    assert d.batch(d.step()) == [("A", 21, 1, "d"), ("B", 20, 1, "d"), ("C", 20, 1, "d")]


def test_fcfs_preempts_the_most_recently_admitted_recomputes_it_later_and_admits_nothing_meanwhile(make_driver):
    d = make_driver(num_blocks=6, block_manager="paged")
    add_all(d.engine, ("A", 0.0, 8, 4), ("B", 0.0, 4, 4), ("C", 0.0, 8, 4))
    assert d.batch(d.step()) == [("A", 0, 8, "p"), ("B", 0, 4, "p"), ("C", 0, 8, "p")]
    d.engine.add_request("D", 0.5, 2, 2)  # would fit in the block C's preemption leaves free

    plan = d.step()  # A takes the last free block; B cannot grow: C, admitted last, is the victim
    assert plan.preempted == [("C", "recompute")]
    assert d.batch(plan) == [("A", 8, 1, "d"), ("B", 4, 1, "d")]
    assert plan.block_tables == {"A": [0, 1, 5], "B": [2, 4]}
    assert d.batch(d.step()) == [("A", 9, 1, "d"), ("B", 5, 1, "d")]  # C (9 tokens, 3 blocks) heads the queue: D waits
    assert d.batch(d.step()) == [("A", 10, 1, "d"), ("B", 6, 1, "d")]
    assert d.finished == ["A", "B"]
    assert d.batch(d.step()) == [("C", 0, 9, "p"), ("D", 0, 2, "p")]  # prompt + its 1 sampled token, from scratch
    d.run()
    assert d.engine.requests["C"].num_preemptions == 1 and d.engine.requests["C"].num_output_tokens == 4


def test_priority_admits_by_priority_then_arrival(make_driver):
    def order(scheduler: str) -> list[list[str]]:
        d = make_driver(scheduler=scheduler, max_num_seqs=2)
        add_all(d.engine, ("A", 0.0, 4, 1, {"priority": 2}), ("B", 0.1, 4, 1, {"priority": 1}),
                ("C", 0.05, 4, 1, {"priority": 1}), ("D", 0.2, 4, 1, {"priority": 0}))  # fmt: skip
        return [[e.request_id for e in p.entries] for p in d.run()]

    assert order("priority") == [["D", "C"], ["B", "A"]]
    assert order("fcfs") == [["A", "B"], ["C", "D"]]


@pytest.mark.parametrize(
    ("scheduler", "batch", "victim"),
    [
        ("priority", [("X", 8, 1, "d")], "W"),  # the worst priority, although it was admitted first
        ("fcfs", [("W", 5, 1, "d")], "X"),  # the most recently admitted: X itself
    ],
)
def test_priority_preempts_the_worst_priority_even_when_it_already_has_its_tokens_this_step(
    make_driver, scheduler, batch, victim
):
    d = make_driver(num_blocks=4, block_manager="paged", scheduler=scheduler)
    d.engine.add_request("W", 0.0, 4, 8, priority=3)
    d.step()
    d.engine.add_request("X", 0.5, 8, 8, priority=0)
    assert d.batch(d.step()) == [("W", 4, 1, "d"), ("X", 0, 8, "p")]
    plan = d.step()  # W's decode is scheduled first; then X needs a block and none is left
    assert plan.preempted == [(victim, "recompute")]
    assert d.batch(plan) == batch
    d.run()


def test_a_step_that_preempts_admits_no_one_even_a_request_that_would_fit(make_driver):
    """Priority: the victim W (priority 3) queues behind Y (priority 1), and Y would fit in the
    block W's preemption leaves free; Y still waits for the next step."""
    d = make_driver(num_blocks=4, block_manager="paged", scheduler="priority")
    d.engine.add_request("W", 0.0, 4, 8, priority=3)
    d.step()
    d.engine.add_request("X", 0.5, 8, 8, priority=0)
    d.step()
    d.engine.add_request("Y", 1.5, 4, 2, priority=1)
    plan = d.step()
    assert plan.preempted == [("W", "recompute")]
    assert d.batch(plan) == [("X", 8, 1, "d")] and d.engine.kv_stats().free == 1
    assert d.batch(d.step()) == [("X", 9, 1, "d"), ("Y", 0, 4, "p")]
    d.run()


@pytest.mark.parametrize(
    ("scheduler", "step_1"),
    [
        ("chunked", [("P", 4, 1, "d"), ("P#1", 4, 1, "d"), ("A", 12, 14, "p")]),
        ("fcfs", [("P", 4, 1, "d"), ("A", 12, 15, "p")]),  # A's chunk takes the budget: the sample P#1 stalls
    ],
)
def test_chunked_prefill_serves_every_decode_before_prefill_chunks(make_driver, scheduler, step_1):
    d = make_driver(scheduler=scheduler, max_num_batched_tokens=16)
    add_all(d.engine, ("P", 0.0, 4, 8, {"n_samples": 2}), ("A", 0.0, 40, 2))
    plan = d.step()
    assert d.batch(plan) == [("P", 0, 4, "p"), ("A", 0, 12, "p")]
    assert plan.forks == [("P", ["P#1"])]  # the sample joins the running list behind A
    assert d.batch(d.step()) == step_1
    d.run()


def test_sjf_admits_the_shortest_prompt_first(make_driver):
    d = make_driver(scheduler="sjf", scheduler_params={"aging_tokens_per_s": 0.0}, max_num_seqs=1)
    add_all(d.engine, ("L", 0.0, 20, 1), ("S", 0.0, 4, 1), ("M", 0.0, 10, 1))
    d.run()
    assert admitted_steps(d.engine) == {"S": 0, "M": 1, "L": 2}


@pytest.mark.parametrize(("oracle", "expected"), [(True, {"Y": 0, "Z": 1, "X": 4}), (False, {"X": 0, "Y": 5, "Z": 6})])
def test_sjf_with_the_oracle_admits_the_shortest_known_output_first(make_driver, oracle, expected):
    d = make_driver(scheduler="sjf", scheduler_params={"oracle": oracle, "aging_tokens_per_s": 0.0}, max_num_seqs=1)
    add_all(d.engine, ("X", 0.0, 8, 5), ("Y", 0.0, 8, 1), ("Z", 0.0, 8, 3))
    d.run()
    assert admitted_steps(d.engine) == expected


@pytest.mark.parametrize(("aging", "admitted"), [(4.0, 7), (0.0, 20)])
def test_sjf_aging_admits_a_long_request_despite_a_stream_of_short_ones(make_driver, aging, admitted):
    """A 30-token prompt waits behind 4-token ones arriving every step. With aging 4 tokens/s
    its key 30 - 4t drops below a fresh short one's 4 at t = 7; without aging it starves
    until the stream stops after step 19."""
    d = make_driver(scheduler="sjf", scheduler_params={"aging_tokens_per_s": aging}, max_num_seqs=1)
    d.engine.add_request("L", 0.0, 30, 1)
    for k in range(20):
        d.engine.add_request(f"s{k}", d.now, 4, 1)
        d.step()
    d.run()
    assert d.engine.requests["L"].admitted_step == admitted


@pytest.mark.parametrize(("aging", "admitted"), [(0.1, 10), (0.0, 20)])
def test_priority_aging_admits_a_low_priority_request_despite_a_stream_of_high_priority_ones(
    make_driver, aging, admitted
):
    """A priority-1 request waits behind priority-0 ones arriving every step. With aging 0.1 levels/s
    its key 1 + 0.1 * 0 ties a fresh one's 0 + 0.1 t at t = 10 and wins on its earlier arrival;
    without aging it starves until the stream stops after step 19."""
    d = make_driver(scheduler="priority", scheduler_params={"aging_per_s": aging}, max_num_seqs=1)
    d.engine.add_request("L", 0.0, 4, 1, priority=1)
    for k in range(20):
        d.engine.add_request(f"h{k}", d.now, 4, 1, priority=0)
        d.step()
    d.run()
    assert d.engine.requests["L"].admitted_step == admitted


def test_static_batching_runs_a_batch_to_completion_before_admitting_more(make_driver):
    requests = [("A", 0.0, 4, 3), ("B", 0.0, 4, 1), ("C", 0.0, 4, 2), ("D", 0.0, 4, 2), ("E", 0.0, 4, 1)]
    d = make_driver(scheduler="static", scheduler_params={"batch_size": 2})
    add_all(d.engine, *requests)
    d.run()
    assert admitted_steps(d.engine) == {"A": 0, "B": 0, "C": 3, "D": 3, "E": 5}  # B's seat stays empty while A runs

    d = make_driver(scheduler="fcfs")
    add_all(d.engine, *requests)
    d.run()
    assert set(admitted_steps(d.engine).values()) == {0}


def test_swap_preemption_moves_kv_to_the_host_and_back_before_the_request_runs_again(make_driver):
    d = make_driver(num_blocks=6, block_manager="paged", preemption_mode="swap", num_host_blocks=8)
    add_all(d.engine, ("A", 0.0, 8, 4), ("B", 0.0, 4, 4), ("C", 0.0, 8, 4))
    d.step()
    plan = d.step()
    assert plan.preempted == [("C", "swap")]
    assert plan.swap_out == [(3, 0), (4, 1)]  # C's two blocks to host blocks 0 and 1
    c = d.engine.requests["C"]
    assert (c.status, c.num_computed_tokens, list(d.engine.swapped)) == (Status.SWAPPED, 8, [c])
    assert d.engine.kv_stats().host_blocks_used == 2

    assert d.step().swap_in == []  # C needs 3 blocks (2 back + 1 to grow); 1 is free
    d.step()  # A and B finish
    plan = d.step()
    assert plan.swap_in == [(0, 3), (1, 5)]
    assert d.batch(plan) == [("C", 8, 1, "d")]  # resumes where it stopped: nothing recomputed
    assert plan.block_tables == {"C": [3, 5, 1]}
    d.run()
    stats = d.engine.kv_stats()
    assert (stats.swapped_out_blocks, stats.swapped_in_blocks, stats.host_blocks_used) == (2, 2, 0)
    assert (d.engine.counters.swap_preemptions, d.engine.counters.recompute_preemptions) == (1, 0)
    assert c.status is Status.FINISHED and c.num_output_tokens == 4


def test_nothing_is_admitted_in_a_step_with_a_preemption_nor_past_a_swapped_request(make_driver):
    """D (one block) fits in the block C's swap-out leaves free, but a step that preempted
    admits nobody, and while C cannot come back (it needs 3 blocks) D does not jump it."""
    d = make_driver(num_blocks=6, block_manager="paged", preemption_mode="swap", num_host_blocks=8)
    add_all(d.engine, ("A", 0.0, 8, 4), ("B", 0.0, 4, 4), ("C", 0.0, 8, 4))
    d.step()
    d.engine.add_request("D", 0.5, 2, 2)
    plan = d.step()
    assert plan.preempted == [("C", "swap")]
    assert d.batch(plan) == [("A", 8, 1, "d"), ("B", 4, 1, "d")]
    assert d.engine.kv_stats().free == 1
    assert d.batch(d.step()) == [("A", 9, 1, "d"), ("B", 5, 1, "d")]
    assert d.batch(d.step()) == [("A", 10, 1, "d"), ("B", 6, 1, "d")]
    plan = d.step()
    assert d.batch(plan) == [("C", 8, 1, "d"), ("D", 0, 2, "p")]  # swapped requests first, then waiting ones
    assert plan.swap_in == [(0, 3), (1, 5)]
    d.run()


def test_swap_falls_back_to_recompute_when_the_host_pool_is_too_small(make_driver):
    d = make_driver(num_blocks=6, block_manager="paged", preemption_mode="swap", num_host_blocks=1)
    add_all(d.engine, ("A", 0.0, 8, 4), ("B", 0.0, 4, 4), ("C", 0.0, 8, 4))
    d.step()
    plan = d.step()
    assert plan.preempted == [("C", "recompute")] and plan.swap_out == []
    assert d.engine.requests["C"].num_computed_tokens == 0
    d.run()


@pytest.mark.parametrize(("watermark", "admitted"), [(0.2, ["A", "B"]), (0.0, ["A", "B", "C"])])
def test_the_watermark_holds_blocks_back_from_admission_but_not_from_running_requests(make_driver, watermark, admitted):
    d = make_driver(num_blocks=10, watermark=watermark, max_num_batched_tokens=64, block_manager="paged")
    add_all(d.engine, ("A", 0.0, 16, 8), ("B", 0.0, 16, 8), ("C", 0.0, 4, 2))
    assert [e.request_id for e in d.step().entries] == admitted  # C would leave 1 block < the 2 held back
    if watermark:
        assert d.batch(d.step()) == [("A", 16, 1, "d"), ("B", 16, 1, "d")]  # both grow into the held-back blocks
        assert d.engine.kv_stats().free == 0
    d.run()


def test_a_custom_policy_loads_by_module_path_with_parameters_from_its_toml_run_config(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from kvsim.sim.run.config import load_run_config, resolve

    engine = resolve(load_run_config(EXAMPLES / "capped_admission.toml")).new_engine()
    assert type(engine.policy).__name__ == "CappedAdmission" and engine.policy.max_new_per_step == 2
    for i in range(5):
        engine.add_request(f"r{i}", 0.0, 4, 1)
    steps = 0
    while engine.has_unfinished():
        engine.commit(engine.schedule(float(steps)), float(steps + 1))
        engine.check_invariants()
        steps += 1
    assert admitted_steps(engine) == {"r0": 0, "r1": 0, "r2": 1, "r3": 1, "r4": 2}  # FCFS: all five at step 0


@pytest.mark.parametrize(
    ("scheduler", "batch", "victim"),
    [
        ("capped_admission:CappedAdmission", [("A", 4, 1, "d"), ("C", 4, 1, "d")], "B"),  # B holds 16 tokens
        ("fcfs", [("A", 4, 1, "d"), ("B", 16, 1, "d")], "C"),
    ],
)
def test_the_custom_policy_preempts_the_request_holding_the_most_kv(make_driver, monkeypatch, scheduler, batch, victim):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    d = make_driver(num_blocks=8, block_manager="paged", scheduler=scheduler,
                    scheduler_params={"max_new_per_step": 3} if ":" in scheduler else {})  # fmt: skip
    add_all(d.engine, ("A", 0.0, 4, 8), ("B", 0.0, 16, 8), ("C", 0.0, 4, 8))
    d.step()
    plan = d.step()  # A and B take the two free blocks; C cannot grow
    assert plan.preempted == [(victim, "recompute")]
    assert d.batch(plan) == batch
    d.run()


def test_a_policy_parameter_it_does_not_take_is_named(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    config = EngineConfig(num_blocks=8, scheduler="capped_admission:CappedAdmission", scheduler_params={"max_new": 1})
    with pytest.raises(ValueError, match=r"does not take parameter\(s\) \['max_new'\]"):
        EngineCore(config)


def test_a_policy_reads_a_live_read_only_view_of_the_engine(make_driver):
    """Hooks get the engine's queues, pool and clock as they stand, and cannot change them."""
    seen = []

    class Recording(FCFSPolicy):
        def admission_open(self, view) -> bool:
            seen.append((view.now, view.step, len(view.running), len(view.waiting), view.num_free_blocks))
            with pytest.raises(AttributeError):
                view.running.append(None)  # a window, not the engine's list
            with pytest.raises(dataclasses.FrozenInstanceError):
                view.config.max_num_seqs = 1
            return True

    d = make_driver(block_manager="paged")
    d.engine.policy = Recording()
    add_all(d.engine, ("A", 0.0, 8, 2), ("B", 0.0, 40, 2))  # B's 40 tokens exceed the 32-token budget
    d.step()
    d.step()
    # At step 1 the view is live: A (9 tokens, 3 blocks) and B (40 tokens, 10 blocks) already grew.
    assert seen[:2] == [(0.0, 0, 0, 2, 16), (1.0, 1, 2, 0, 16 - 3 - 10)]
    assert d.engine.view.kv_stats().used == 10  # A finished at step 1: B alone
