"""The prefill-first scheduler (``vllm-v0``): vLLM V0 / vllm-ascend AscendScheduler step semantics.

Engine geometry from conftest's SMALL_ENGINE: 4-token blocks, 16 blocks, a 32-token budget,
8 sequences, the ``paged`` manager, one step per time unit.
"""

from __future__ import annotations

import pytest

from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore


def add_all(engine, *requests) -> None:
    for rid, arrival, prompt, output in requests:
        engine.add_request(rid, arrival, prompt, output)


def test_a_waiting_prompt_that_fits_gets_a_prefill_only_step_and_decodes_wait(make_driver):
    d = make_driver(scheduler="vllm-v0", block_manager="paged")
    add_all(d.engine, ("A", 0.0, 20, 4), ("B", 0.0, 20, 4))
    assert d.batch(d.step()) == [("A", 0, 20, "p")]  # B's 20 tokens do not fit the rest of the budget: no chunk
    d.engine.add_request("C", 1.0, 8, 2)
    assert d.batch(d.step()) == [("B", 0, 20, "p"), ("C", 0, 8, "p")]  # A does not decode meanwhile
    assert d.batch(d.step()) == [("A", 20, 1, "d"), ("B", 20, 1, "d"), ("C", 8, 1, "d")]


def test_fcfs_mixes_the_same_requests_into_one_chunked_step(make_driver):
    """The contrast the policy exists for: V1's fcfs chunks B and decodes A alongside."""
    d = make_driver(scheduler="fcfs", block_manager="paged")
    add_all(d.engine, ("A", 0.0, 20, 4), ("B", 0.0, 20, 4))
    assert d.batch(d.step()) == [("A", 0, 20, "p"), ("B", 0, 12, "p")]
    assert d.batch(d.step()) == [("A", 20, 1, "d"), ("B", 12, 8, "p")]


def test_running_requests_decode_when_the_head_prompt_does_not_fit_the_pool(make_driver):
    d = make_driver(scheduler="vllm-v0", block_manager="paged", num_blocks=12)
    add_all(d.engine, ("A", 0.0, 28, 4))
    assert d.batch(d.step()) == [("A", 0, 28, "p")]  # 7 of 12 blocks
    d.engine.add_request("B", 1.0, 24, 4)  # needs 6 blocks, 5 are free: decode instead of an empty step
    assert d.batch(d.step()) == [("A", 28, 1, "d")]
    assert d.batch(d.step()) == [("A", 29, 1, "d")]
    d.run()
    assert d.finished == ["A", "B"]


def test_max_num_seqs_holds_prompts_back_and_decodes_run(make_driver):
    d = make_driver(scheduler="vllm-v0", block_manager="paged", max_num_seqs=2)
    add_all(d.engine, ("A", 0.0, 4, 3), ("B", 0.0, 4, 3), ("C", 0.0, 4, 3))
    assert d.batch(d.step()) == [("A", 0, 4, "p"), ("B", 0, 4, "p")]
    assert d.batch(d.step()) == [("A", 4, 1, "d"), ("B", 4, 1, "d")]  # C waits for a seat
    d.run()
    assert d.finished == ["A", "B", "C"]


def test_a_recomputed_request_is_prefilled_again_ahead_of_decodes(make_driver):
    d = make_driver(scheduler="vllm-v0", block_manager="paged", num_blocks=6)
    add_all(d.engine, ("A", 0.0, 8, 4), ("B", 0.0, 4, 4), ("C", 0.0, 8, 4))
    assert d.batch(d.step()) == [("A", 0, 8, "p"), ("B", 0, 4, "p"), ("C", 0, 8, "p")]
    plan = d.step()  # A takes the last free block; B cannot grow: C, admitted last, is preempted
    assert plan.preempted == [("C", "recompute")]
    d.run()
    assert d.finished == ["A", "B", "C"] and d.engine.requests["C"].num_preemptions == 1
    prefills = [d.batch(p) for p in d.plans if any(e.is_prefill for e in p.entries)]
    assert all(all(kind == "p" for *_, kind in batch) for batch in prefills)  # never mixed with decodes


def test_whole_prompts_only_so_a_prompt_beyond_the_budget_is_rejected(make_engine):
    engine = make_engine(scheduler="vllm-v0", block_manager="paged")
    assert engine.add_request("L", 0.0, 40, 2).reject_reason == "exceeds_token_budget"


def test_chunked_prefill_cannot_be_switched_on():
    config = EngineConfig(num_blocks=16, scheduler="vllm-v0", scheduler_params={"chunked_prefill": True})
    with pytest.raises(ValueError, match="whole prompts"):
        EngineCore(config)
