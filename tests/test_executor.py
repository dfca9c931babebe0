"""The real executor against hand-written StepPlans on the cpu backend (tiny model, fp32).

Every scenario's generated tokens must equal dense greedy generation of the same prompt: the
paged path (slot mapping, block tables, shared prefix blocks, copy-on-write, swap, recompute)
is correct exactly when it reproduces full recomputation over the contiguous sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from kvsim.policies.plan import PlanEntry, StepPlan  # noqa: E402
from kvsim.policies.request import Request  # noqa: E402
from kvsim.realexec.backends import get_backend  # noqa: E402
from kvsim.realexec.executor import Executor  # noqa: E402
from kvsim.realexec.prompts import prompt_tokens  # noqa: E402
from kvsim.realexec.reference import dense_generate  # noqa: E402
from kvsim.sim.perf.model_spec import load_model  # noqa: E402
from kvsim.sim.perf.step_timer import StepTiming  # noqa: E402

TINY = load_model("tiny")
BS = 16  # block size
SEED = 0


def plan(step: int, entries: list[tuple[str, int, int, bool]], tables: dict[str, list[int]], **moves) -> StepPlan:
    """A StepPlan whose slot mapping follows the block tables: slot = table[p // bs] * bs + p % bs."""
    slots = [tables[rid][p // BS] * BS + p % BS for rid, first, n, _ in entries for p in range(first, first + n)]
    return StepPlan(
        step=step,
        entries=[PlanEntry(rid, first, n, n > 1 or not samples, samples) for rid, first, n, samples in entries],
        block_tables={rid: list(tables[rid]) for rid, *_ in entries},
        slot_mapping=slots,
        **moves,
    )


@dataclass
class Scenario:
    """A hand-driven engine: the test picks blocks and positions, this numbers steps and decodes."""

    ex: Executor
    tables: dict[str, list[int]] = field(default_factory=dict)
    prompt_lens: dict[str, int] = field(default_factory=dict)
    spare: list[int] = field(default_factory=lambda: list(range(63, 40, -1)))  # for decodes
    step_no: int = 0

    def add(self, rid: str, seq_id: int, prompt_len: int, **kw) -> list[int]:
        request = Request(rid, seq_id, 0.0, prompt_len, 16, **kw)
        self.ex.add_request(request)
        self.prompt_lens[rid] = prompt_len
        return prompt_tokens(request, TINY.vocab_size, SEED)

    def run(self, entries: list[tuple[str, int, int, bool]], **moves) -> StepTiming:
        timing = self.ex.step(plan(self.step_no, entries, self.tables, **moves))
        self.step_no += 1
        return timing

    def decode(self, rids: list[str], count: int, **first_moves) -> None:
        """``count`` steps decoding ``rids`` together, appending a spare block at a block boundary.

        ``first_moves`` (swaps, copies) go with the first of these steps.
        """
        for i in range(count):
            entries = []
            for rid in rids:
                position = self.prompt_lens[rid] + len(self.ex.tokens(rid)) - 1
                if position // BS == len(self.tables[rid]):
                    self.tables[rid].append(self.spare.pop())
                entries.append((rid, position, 1, True))
            self.run(entries, **(first_moves if i == 0 else {}))


@pytest.fixture
def sc() -> Scenario:
    return Scenario(Executor(TINY, get_backend("cpu"), num_blocks=64, block_size=BS, num_host_blocks=16, seed=SEED, check=True))


def test_prefill_then_decodes(sc: Scenario) -> None:
    prompt = sc.add("a", 0, 45)
    sc.tables["a"] = [3, 7, 1]  # deliberately out of order
    timing = sc.run([("a", 0, 45, True)])
    assert timing.duration_s == pytest.approx(timing.device_s + timing.host_s)
    assert timing.device_s > 0 and timing.host_s > 0 and set(timing.operators) == {"forward"}
    assert timing.memory_bytes == sum(k.nbytes + v.nbytes for k, v in sc.ex.kv_caches)  # the cpu backend counts its KV pool
    sc.decode(["a"], 9)  # crosses into a 4th block at position 48
    assert len(sc.tables["a"]) == 4
    assert sc.ex.tokens("a") == dense_generate(sc.ex.model, prompt, 10)


def test_chunked_prefill_in_two_chunks_beside_a_decode(sc: Scenario) -> None:
    prompt_a, prompt_b = sc.add("a", 0, 20), sc.add("b", 1, 45)
    sc.tables.update(a=[5, 6], b=[9, 2, 8])
    sc.run([("a", 0, 20, True)])
    sc.run([("a", 20, 1, True), ("b", 0, 32, False)])  # mixed batch: a decode and b's first chunk
    assert sc.ex.tokens("b") == []
    sc.run([("a", 21, 1, True), ("b", 32, 13, True)])
    sc.decode(["a", "b"], 5)
    assert sc.ex.tokens("a") == dense_generate(sc.ex.model, prompt_a, 8)
    assert sc.ex.tokens("b") == dense_generate(sc.ex.model, prompt_b, 6)


def test_shared_prefix_blocks_are_read_not_recomputed(sc: Scenario) -> None:
    prompt_a = sc.add("a", 0, 40, trace_hashes=(101, 202, 303), hash_block_size=BS)
    prompt_b = sc.add("b", 1, 40, trace_hashes=(101, 202, 404), hash_block_size=BS)
    assert prompt_a[:32] == prompt_b[:32] and prompt_a[32:] != prompt_b[32:]
    sc.tables.update(a=[4, 10, 12], b=[4, 10, 14])  # b's first two blocks are a's cached ones
    sc.run([("a", 0, 40, True)])
    sc.run([("a", 40, 1, True), ("b", 32, 8, True)])  # b computes only its last 8 tokens
    sc.decode(["a", "b"], 4)
    assert sc.ex.tokens("a") == dense_generate(sc.ex.model, prompt_a, 6)
    assert sc.ex.tokens("b") == dense_generate(sc.ex.model, prompt_b, 5)


def test_fork_with_copy_on_write(sc: Scenario) -> None:
    prompt = sc.add("p", 0, 40, n_samples=2)
    sc.tables["p"] = [4, 6, 8]
    sc.run([("p", 0, 40, True)], forks=[("p", ["p-1"])])
    assert sc.ex.tokens("p-1") == sc.ex.tokens("p") and len(sc.ex.tokens("p")) == 1
    # Both write position 40 into the shared, partly filled block 8: the child copies it first.
    sc.prompt_lens["p-1"] = 40
    sc.tables["p-1"] = [4, 6, 20]
    timing = sc.run([("p", 40, 1, True), ("p-1", 40, 1, True)], copies=[(8, 20)])
    assert "copy" in timing.operators
    sc.decode(["p", "p-1"], 5)
    expected = dense_generate(sc.ex.model, prompt, 7)
    assert sc.ex.tokens("p") == expected and sc.ex.tokens("p-1") == expected


def test_swap_out_and_back_in(sc: Scenario) -> None:
    prompt_a, prompt_b = sc.add("a", 0, 40), sc.add("b", 1, 30)
    sc.tables["a"] = [1, 2, 3]
    sc.run([("a", 0, 40, True)])
    sc.decode(["a"], 3)
    # a is swapped out, and b at once reuses a's freed device blocks 1 and 2, overwriting them:
    # only a swap-out that runs before the forward pass keeps a's KV.
    sc.tables["b"] = [2, 1]
    timing = sc.run([("b", 0, 30, True)], swap_out=[(1, 5), (2, 6), (3, 7)], preempted=[("a", "swap")])
    assert "swap" in timing.operators
    sc.decode(["b"], 3)  # b's third block comes from the spare list
    # In one step b leaves and a comes back into b's blocks: swap-out must run before swap-in.
    b_out = [(2, 8), (1, 9), (sc.tables["b"][2], 10)]
    sc.tables["a"] = [2, 1, 3]
    sc.decode(["a"], 2, swap_out=b_out, swap_in=[(5, 2), (6, 1), (7, 3)])
    sc.tables["b"] = [30, 31, 32]
    sc.decode(["a", "b"], 3, swap_in=[(8, 30), (9, 31), (10, 32)])
    assert sc.ex.tokens("a") == dense_generate(sc.ex.model, prompt_a, 9)
    assert sc.ex.tokens("b") == dense_generate(sc.ex.model, prompt_b, 7)


def test_recompute_refeeds_prompt_and_generated_tokens(sc: Scenario) -> None:
    prompt_a, prompt_b = sc.add("a", 0, 40), sc.add("b", 1, 40)
    sc.tables["a"] = [1, 2, 3]
    sc.run([("a", 0, 40, True)])
    sc.decode(["a"], 3)  # a knows 44 tokens, 43 of them in the cache
    sc.tables["b"] = [3, 2, 1]  # a is preempted by recompute; b overwrites all its blocks
    sc.run([("b", 0, 40, True)], preempted=[("a", "recompute")])
    sc.tables["a"] = [9, 10, 11]
    sc.run([("a", 0, 44, True), ("b", 40, 1, True)])  # positions from 0 again, over 44 tokens
    sc.decode(["a", "b"], 2)
    assert sc.ex.tokens("a") == dense_generate(sc.ex.model, prompt_a, 7)
    assert sc.ex.tokens("b") == dense_generate(sc.ex.model, prompt_b, 4)


def test_bad_plans_are_rejected_with_the_reason(sc: Scenario) -> None:
    sc.add("a", 0, 20)
    bad = plan(0, [("a", 0, 20, True)], {"a": [1, 2]})
    bad.slot_mapping[17] = 40  # a free slot of block 2, not in a's table
    with pytest.raises(AssertionError, match="step 0: a position 17 has the wrong slot"):
        sc.ex.step(bad)
    with pytest.raises(ValueError, match=r"request a: plan asks for positions \[0, 25\) but 20 tokens are known"):
        sc.ex.step(plan(0, [("a", 0, 25, True)], {"a": [1, 2]}))
    with pytest.raises(ValueError, match="entry samples after position 9, but the next token to generate is position 20"):
        sc.ex.step(plan(0, [("a", 0, 10, True)], {"a": [1]}))
    with pytest.raises(ValueError, match=r"device block id 64 out of range \[0, 64\)"):
        sc.ex.step(plan(0, [("a", 0, 20, True)], {"a": [1, 64]}))
    with pytest.raises(ValueError, match="request 'zz', which was never added"):
        sc.ex.step(plan(0, [("zz", 0, 1, True)], {"zz": [1]}))


def test_a_steps_time_is_its_median_pass_and_its_first_pass_is_kept(sc: Scenario, monkeypatch) -> None:
    """Repeated passes change no token (covered above with the default eleven); the time is the median run's."""
    passes = []
    timed_pass = sc.ex._timed_pass

    def recording(plan):
        result = timed_pass(plan)
        passes.append(result)
        return result

    monkeypatch.setattr(sc.ex, "_timed_pass", recording)
    sc.add("a", 0, 33)
    sc.tables["a"] = [4, 5, 6]
    timing = sc.run([("a", 0, 33, True)])
    assert sc.ex.timing_repeats == len(passes) == 11
    totals = sorted(p.host_s + p.forward_s for p in passes)
    assert timing.duration_s == pytest.approx(totals[5])
    assert sc.ex.single_run_s == [pytest.approx(passes[0].host_s + passes[0].forward_s)]
    assert all(torch.equal(p.sampled, passes[0].sampled) for p in passes)
    passes.clear()
    timing = sc.ex.step(plan(9, [("a", 33, 1, True)], sc.tables), repeats=1)
    assert len(passes) == 1 and sc.ex.single_run_s[-1] == pytest.approx(timing.duration_s)


def test_timing_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timing_repeats must be at least 1"):
        Executor(TINY, get_backend("cpu"), num_blocks=4, block_size=BS, timing_repeats=0)


def test_retime_times_every_kept_step_again_pass_after_pass_and_changes_no_token() -> None:
    """A swap step keeps the moves the run measured; the kept plans' samples were decided before later tokens existed."""
    sc = Scenario(Executor(TINY, get_backend("cpu"), num_blocks=64, block_size=BS, num_host_blocks=16, seed=SEED,
                           keep_plans=True, timing_repeats=3))
    sc.add("a", 0, 30)
    sc.tables["a"] = [4, 5]
    sc.run([("a", 0, 30, True)])
    sc.decode(["a"], 3)
    sc.run([], swap_out=[(4, 0)])  # a step of block moves alone: nothing to run again
    tokens = list(sc.ex.tokens("a"))
    moves = sc.ex.kept_plans[-1][1]
    seen: list[int] = []
    passes = sc.ex.retime(2, progress=lambda: seen.append(1))
    assert len(passes) == 2 and seen == [1, 1] and all(len(p) == 5 for p in passes)
    assert all(d > 0 for p in passes for d in p[:4]) and all(p[4] == moves > 0 for p in passes)
    assert sc.ex.tokens("a") == tokens and sc.ex.single_run_s and len(sc.ex.single_run_s) == 5  # nothing appended
    with pytest.raises(ValueError, match="samples after position"):  # the run's own check is back after retiming
        sc.ex.step(plan(99, [("a", 30, 1, True)], sc.tables))


def test_retime_needs_the_plans_kept() -> None:
    with pytest.raises(ValueError, match="keep_plans=True"):
        Executor(TINY, get_backend("cpu"), num_blocks=4, block_size=BS).retime(1)
