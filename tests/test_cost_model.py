"""Cost model: features from plans, roofline sanity, one step vs many at once (calibration: test_cost_fit.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.policies.plan import PlanEntry, StepPlan
from kvsim.sim.perf.cost_model import (
    OPERATORS,
    CostModel,
    CostModelTimer,
    StepFeatures,
    features_from_plan,
    in_order_sum,
)
from kvsim.sim.perf.device import OperatorCoefficients, load_device
from kvsim.sim.perf.expert_routing import ExpertRouting
from kvsim.sim.perf.model_spec import load_model

FEATURE_NAMES = [f.name for f in dataclasses.fields(StepFeatures)]


def decode_plan(contexts: list[int], step: int = 0) -> StepPlan:
    """One decode token per sequence, written at position ``context``."""
    return StepPlan(step=step, entries=[PlanEntry(f"r{i}", c, 1, False, True) for i, c in enumerate(contexts)])


def prefill_plan(num_tokens: int, cached: int = 0) -> StepPlan:
    return StepPlan(step=0, entries=[PlanEntry("p", cached, num_tokens, True, True)])


def features(**values: float) -> StepFeatures:
    return StepFeatures(**{name: float(values.get(name, 0.0)) for name in FEATURE_NAMES})


@pytest.fixture(scope="module")
def llama_910b() -> CostModel:
    llama_bf16 = dataclasses.replace(load_model("llama-2-7b"), weight_dtype="bf16", kv_dtype="bf16")
    return CostModel(llama_bf16, load_device("ascend-910b3"), block_size=128)


def test_features_of_a_mixed_plan() -> None:
    plan = StepPlan(
        step=3,
        entries=[
            PlanEntry("chunk", 100, 50, True, False),  # a middle prefill chunk: 100 cached, 50 new
            PlanEntry("last", 0, 20, True, True),  # a whole short prompt that samples
            PlanEntry("d1", 300, 1, False, True),
            PlanEntry("d2", 7, 1, False, True),
        ],
        copies=[(1, 2)],
        swap_out=[(3, 0), (4, 1)],
        swap_in=[(5, 6)],
    )
    f = features_from_plan(plan, block_size=16)
    assert (f.num_tokens, f.num_seqs, f.num_sampled) == (72, 4, 3)
    assert (f.prefill_tokens, f.decode_seqs) == (70, 2)
    assert f.attn_pairs == (50 * 100 + 50 * 51 / 2) + (20 * 21 / 2)
    assert f.prefill_ctx_tokens == 150 + 20 and f.decode_ctx_tokens == 301 + 8
    assert f.blocks_touched == 10 + 2 + 19 + 1  # ceil(150/16), ceil(20/16), ceil(301/16), ceil(8/16)
    assert (f.copy_blocks, f.swap_blocks) == (1, 3)
    assert all(isinstance(getattr(f, name), float) for name in FEATURE_NAMES)
    # padded: each group at its longest entry, in whole blocks (prefill: 50 rows x 10 blocks; decode: 19 blocks)
    assert (f.padded_attn_pairs, f.padded_prefill_ctx_tokens) == (2 * 50 * 160, 2 * 160)
    assert f.padded_decode_ctx_tokens == 2 * 19 * 16 and f.padded_blocks_touched == 2 * 10 + 2 * 19


def test_padded_attention_pays_for_the_longest_sequence() -> None:
    tiny, cpu = load_model("tiny"), load_device("cpu")
    exact = CostModel(tiny, dataclasses.replace(cpu, padded_attention=False), 16)
    padded = CostModel(tiny, dataclasses.replace(cpu, padded_attention=True, attention_query_tile=0), 16)
    even, ragged = decode_plan([511] * 8), decode_plan([511] + [15] * 7)  # each reads 512 or 16 tokens
    assert padded.step_time(even) == exact.step_time(even)  # block-aligned, equal contexts: no padding
    assert padded.step_time(ragged) == padded.step_time(even) > exact.step_time(ragged)
    # a prompt attends causally; a padded kernel computes the whole square
    f = features_from_plan(prefill_plan(512), 16)
    assert padded.operator_work(f)["attn_prefill"].flops == 2 * exact.operator_work(f)["attn_prefill"].flops * 512 / 513



def test_decode_chain_walks_the_longest_decode_sequence_once_per_layer() -> None:
    """A kernel with one program per (sequence, KV head) takes the longest sequence's walk, however short the rest."""
    small, cpu = load_model("small"), load_device("cpu")
    chained = CostModel(small, cpu.with_operators({"decode_chain": OperatorCoefficients(call_s=1.5e-6)}), 16)
    lone = features_from_plan(decode_plan([999]), 16)  # 1,000 tokens: 63 blocks
    crowd = features_from_plan(decode_plan([999] + [15] * 7), 16)
    assert chained.operator_times(lone)["decode_chain"] == pytest.approx(small.num_layers * 63 * 1.5e-6)
    assert chained.operator_times(crowd)["decode_chain"] == chained.operator_times(lone)["decode_chain"]
    assert chained.operator_times(features_from_plan(prefill_plan(999), 16))["decode_chain"] == 0.0
    # A profile that does not measure the walk (every bundled device) costs it nothing.
    assert CostModel(small, cpu, 16).operator_times(lone)["decode_chain"] == 0.0


def test_prefill_chain_walks_the_longest_prefill_beyond_the_longest_decode() -> None:
    """A prompt's last chunk over a long context walks its blocks in a one-program-per-token kernel; a
    launch for the whole batch ends with its longest walk, of which decode_chain prices the decodes'."""
    small, cpu = load_model("small"), load_device("cpu")
    walks = {"decode_chain": OperatorCoefficients(call_s=1.5e-6), "prefill_chain": OperatorCoefficients(call_s=0.4e-6)}
    chained = CostModel(small, cpu.with_operators(walks), 16)
    chunk = PlanEntry("p", 960, 40, True, True)  # 1,000 tokens of context: 63 blocks
    alone = features_from_plan(StepPlan(step=0, entries=[chunk]), 16)
    assert alone.prefill_max_blocks == 63
    assert chained.operator_times(alone)["prefill_chain"] == pytest.approx(small.num_layers * 63 * 0.4e-6)
    beside = StepPlan(step=0, entries=[chunk, PlanEntry("d", 319, 1, False, True)])  # a decode of 20 blocks
    assert chained.operator_times(features_from_plan(beside, 16))["prefill_chain"] == pytest.approx(small.num_layers * 43 * 0.4e-6)
    longer_decode = StepPlan(step=0, entries=[chunk, PlanEntry("d", 1599, 1, False, True)])
    assert chained.operator_times(features_from_plan(longer_decode, 16))["prefill_chain"] == 0.0
    assert chained.operator_times(features_from_plan(decode_plan([999]), 16))["prefill_chain"] == 0.0
    # Arrays of steps give each step's own walk, as one step at a time does.
    stacked = StepFeatures(**{name: np.array([getattr(features_from_plan(p, 16), name) for p in (beside, longer_decode)])
                              for name in FEATURE_NAMES})
    assert chained.operator_times(stacked)["prefill_chain"] == pytest.approx([small.num_layers * 43 * 0.4e-6, 0.0])
    assert CostModel(small, cpu, 16).operator_times(alone)["prefill_chain"] == 0.0

def test_query_tiles_count_each_tile_against_the_context_its_last_row_sees() -> None:
    """The cpu kernel's prefill tiles (portable.QUERY_TILE rows): the pairs a tile-by-tile sum gives."""
    from kvsim.policies.blocks import cdiv
    from kvsim.realexec.backends.portable import QUERY_TILE

    tiny, cpu = load_model("tiny"), load_device("cpu")
    assert cpu.padded_attention and cpu.attention_query_tile == QUERY_TILE  # the profile states the kernel's constant
    tiled = CostModel(tiny, cpu, 16)
    square = CostModel(tiny, dataclasses.replace(cpu, attention_query_tile=0), 16)
    per_pair = 4 * tiny.q_size * tiny.num_layers
    for cached, new in ((0, 480), (448, 32), (100, 128), (0, 129), (640, 1000), (0, 1)):
        entries = [PlanEntry("a", cached, new, True, True), PlanEntry("b", 7, 1, False, True)]  # a decode beside it
        f = features_from_plan(StepPlan(step=0, entries=entries), 16)
        context = cdiv(cached + new, 16) * 16  # in whole blocks, as padded
        expected = sum(min(QUERY_TILE, new - start) * (context - new + min(start + QUERY_TILE, new))
                       for start in range(0, new, QUERY_TILE))
        assert tiled.operator_work(f)["attn_prefill"].flops == per_pair * expected
        assert square.operator_work(f)["attn_prefill"].flops == per_pair * new * context
    assert tiled.operator_work(features_from_plan(decode_plan([300]), 16)) == square.operator_work(
        features_from_plan(decode_plan([300]), 16))  # decode-only steps: no prefill tiles


def test_decode_at_batch_one_streams_the_weights(llama_910b: CostModel) -> None:
    cm = llama_910b
    t = cm.step_time(decode_plan([0]))
    streamed = cm.model.weight_bytes() / cm.device.hbm_bandwidth  # ideal: every weight read once at peak
    assert 8e-3 < t < 12e-3 and t > streamed
    work = cm.operator_work(features_from_plan(decode_plan([0]), cm.block_size))
    gemm_compute, gemm_memory = (x * r for x, r in zip(work["gemm"][:2], cm.unit_costs("gemm")[:2]))
    assert gemm_memory > 100 * gemm_compute
    assert cm.operator_times(features_from_plan(decode_plan([0]), cm.block_size))["gemm"] > 0.85 * t


def test_prefill_of_2048_tokens_is_compute_bound(llama_910b: CostModel) -> None:
    # with flash attention (no score traffic): the bundled 910B3's fitted score_bytes makes its
    # prefill attention memory-bound, as vllm-ascend v0.9.1's measured long prefills were
    attn = llama_910b.device.operators["attn_prefill"]
    flash = llama_910b.device.with_operators({"attn_prefill": dataclasses.replace(attn, shape=0.0)})
    cm = CostModel(llama_910b.model, flash, llama_910b.block_size)
    assert llama_910b.operator_times(features_from_plan(prefill_plan(2048), 128))["attn_prefill"] > cm.operator_times(
        features_from_plan(prefill_plan(2048), 128)
    )["attn_prefill"]
    f = features_from_plan(prefill_plan(2048), cm.block_size)
    work = cm.operator_work(f)
    for op in ("gemm", "attn_prefill", "lm_head"):
        per_flop, per_byte, _ = cm.unit_costs(op)
        if op != "lm_head":  # one sampled row: the LM head is a GEMV
            assert work[op].flops * per_flop > work[op].bytes * per_byte, op
    flops = sum(work[op].flops for op in ("gemm", "attn_prefill"))
    assert cm.step_time(prefill_plan(2048)) > flops / cm.device.matrix_flops["bf16"]
    # A 2048-token prefill costs far less than 2048 decode steps' weight reads: batching pays.
    assert cm.step_time(prefill_plan(2048)) < 0.2 * 2048 * cm.step_time(decode_plan([0]))


def test_time_grows_with_context(llama_910b: CostModel) -> None:
    times = [llama_910b.step_time(decode_plan([c] * 32)) for c in (0, 512, 2048, 8192)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]
    chunk = [llama_910b.step_time(prefill_plan(512, cached)) for cached in (0, 1024, 4096)]
    assert chunk == sorted(chunk) and chunk[0] < chunk[-1]


def test_smaller_blocks_touch_more_blocks_and_cost_more() -> None:
    model, device = load_model("llama-3-8b"), load_device("ascend-910b3")
    plan = decode_plan([2000 + i for i in range(64)])
    blocks = {bs: features_from_plan(plan, bs).blocks_touched for bs in (16, 32, 64, 128)}
    times = {bs: CostModel(model, device, bs).step_time(plan) for bs in (16, 32, 64, 128)}
    assert blocks[16] > blocks[32] > blocks[64] > blocks[128]
    assert times[16] > times[32] > times[64] > times[128]


def test_int8_kv_reads_fewer_bytes() -> None:
    model, device = load_model("llama-3-8b"), load_device("ascend-910b3")
    plan = decode_plan([4000] * 64)
    bf16, int8 = CostModel(model, device, 128), CostModel(model, device, 128, kv_dtype="int8")
    f = features_from_plan(plan, 128)
    kv_read = {name: cm.operator_work(f)["attn_decode"].bytes for name, cm in (("bf16", bf16), ("int8", int8))}
    query_io = model.num_layers * 2 * model.q_size * 2 * 64  # query in + output out, bf16, per step
    # C8's static per-channel scales live outside the blocks: int8 reads exactly half the KV bytes.
    assert (kv_read["int8"] - query_io) / (kv_read["bf16"] - query_io) == pytest.approx(256 / 512, rel=1e-12)
    assert int8.step_time(plan) < bf16.step_time(plan)


def test_h200_is_faster_than_910b4() -> None:
    model = load_model("qwen3-8b")
    for plan in (decode_plan([1000] * 16), prefill_plan(2048)):
        fast = CostModel(model, load_device("h200"), 128).step_time(plan)
        slow = CostModel(model, load_device("ascend-910b4"), 128).step_time(plan)
        assert fast < slow


def test_copies_count_swaps_do_not(llama_910b: CostModel) -> None:
    base = decode_plan([100, 200])
    with_copy = dataclasses.replace(base, copies=[(1, 2)])
    with_swap = dataclasses.replace(base, swap_out=[(1, 0)] * 4)
    assert llama_910b.step_time(with_copy) > llama_910b.step_time(base)
    assert llama_910b.step_time(with_swap) == llama_910b.step_time(base)
    block = llama_910b.model.bytes_per_block(128)
    one = llama_910b.swap_time(1)
    assert one >= block / llama_910b.device.host_link_bandwidth
    per_block = block / (llama_910b.device.host_link_bandwidth * llama_910b.device.operators["swap"].memory_efficiency)
    assert llama_910b.swap_time(8) - one == pytest.approx(7 * per_block, rel=1e-12)
    assert llama_910b.swap_time(0) == 0.0
    assert llama_910b.step_time(StepPlan(step=0)) == 0.0


def test_timer_reports_the_step_time_and_its_swap(llama_910b: CostModel) -> None:
    timer = CostModelTimer(llama_910b)
    plan = StepPlan(step=0, entries=[PlanEntry("p", 0, 300, True, True), PlanEntry("d", 40, 1, False, True)], copies=[(3, 4)])
    timing = timer.step(plan)
    split = llama_910b.step_split(features_from_plan(plan, llama_910b.block_size))
    assert timing.duration_s == llama_910b.step_time(plan) == in_order_sum(split.values())  # the split's own order, bit for bit
    assert timing.operators == {} and split["block_copy"] > 0
    swapping = timer.step(dataclasses.replace(plan, swap_out=[(1, 2), (5, 6)]))
    assert swapping.operators == {"swap": llama_910b.swap_time(2)}
    assert swapping.duration_s == timing.duration_s + llama_910b.swap_time(2)


def test_operator_times_work_on_arrays(llama_910b: CostModel) -> None:
    rng = np.random.default_rng(7)
    size = 50
    arrays = {name: rng.integers(0, 3, size) * rng.integers(1, 5000, size).astype(float) for name in FEATURE_NAMES}
    batched = llama_910b.operator_times(StepFeatures(**arrays))
    for k in range(size):
        one = llama_910b.operator_times(StepFeatures(**{name: float(arrays[name][k]) for name in FEATURE_NAMES}))
        for op in OPERATORS:
            assert np.broadcast_to(batched[op], (size,))[k] == pytest.approx(one[op], rel=1e-12, abs=0)


@settings(max_examples=80, deadline=None)
@given(
    base=st.fixed_dictionaries({name: st.integers(0, 50_000) for name in FEATURE_NAMES}),
    name=st.sampled_from([n for n in FEATURE_NAMES if n != "swap_blocks"]),
    extra=st.integers(1, 10_000),
)
def test_more_of_any_feature_never_takes_less_time(llama_910b: CostModel, base: dict, name: str, extra: int) -> None:
    more = {**base, name: base[name] + extra}
    assert llama_910b.predict(features(**more)) >= llama_910b.predict(features(**base))


def test_no_operator_beats_its_roofline(llama_910b: CostModel) -> None:
    f = features_from_plan(StepPlan(step=0, entries=[PlanEntry("p", 64, 1000, True, True), PlanEntry("d", 900, 1, False, True)]), 128)
    times, work = llama_910b.operator_times(f), llama_910b.operator_work(f)
    for op in OPERATORS:
        peak, bandwidth = llama_910b.roofs(op)
        assert times[op] >= max(work[op].flops / peak, work[op].bytes / bandwidth), op


# --- the engine: eager dispatch, graph replay with padding, async scheduling, operator shapes ----
# The bundled 910B3's fitted host terms set to 0: tests of one engine effect isolate it.
NO_HOST = {op: OperatorCoefficients(call_s=0.0) for op in ("host_step", "host_seq", "host_token")}


def _with_engine(cost: CostModel, **changes) -> CostModel:
    device = cost.device
    engine_keys = ("mode", "dispatch_s", "capture_sizes", "async_scheduling")
    engine = dataclasses.replace(device.engine, **{k: v for k, v in changes.items() if k in engine_keys})
    ops = {k: v for k, v in changes.items() if k in OPERATORS}
    return CostModel(cost.model, dataclasses.replace(device, engine=engine).with_operators(ops), cost.block_size)


def test_eager_small_decode_is_bound_by_dispatch(llama_910b: CostModel) -> None:
    eager = _with_engine(llama_910b, mode="eager", dispatch_s=1e-4, **NO_HOST)
    f = features_from_plan(decode_plan([500] * 4), 128)
    split = eager.step_split(f)
    not_kernels = ("paged_gather", "decode_chain", "swap", "host_step", "host_seq", "host_token")
    calls = sum(w.calls for op, w in eager.operator_work(f).items() if op not in not_kernels)
    assert eager.predict(f) == pytest.approx(calls * 1e-4)  # dispatch outlasts the device: it sets the step
    assert split["dispatch_stall"] > 0 and sum(split.values()) == pytest.approx(eager.predict(f))
    big = features_from_plan(prefill_plan(8192), 128)
    assert eager.step_split(big)["dispatch_stall"] == 0  # a large prefill keeps the device busier than dispatch


def test_graph_steps_pad_tokens_to_the_captured_size_and_skip_dispatch(llama_910b: CostModel) -> None:
    graph = _with_engine(llama_910b, mode="graph", dispatch_s=1e-4, capture_sizes=(1, 2, 4, 8))
    three, four = (features_from_plan(decode_plan([500] * n), 128) for n in (3, 4))
    assert graph.operator_work(three)["gemm"].flops == graph.operator_work(four)["gemm"].flops  # padded 3 -> 4
    assert graph.step_split(three)["dispatch_stall"] == 0
    nine = features_from_plan(decode_plan([500] * 9), 128)  # beyond the largest graph: eager, unpadded
    assert graph.operator_work(nine)["gemm"].flops == pytest.approx(9 / 4 * graph.operator_work(four)["gemm"].flops)
    assert graph.step_split(nine)["dispatch_stall"] > 0


def test_async_scheduling_hides_host_work_behind_the_device(llama_910b: CostModel) -> None:
    host = {**NO_HOST, "host_step": OperatorCoefficients(call_s=2e-3)}
    sync = _with_engine(llama_910b, mode="graph", capture_sizes=(1, 2, 4, 8), **host)
    overlap = _with_engine(llama_910b, mode="graph", capture_sizes=(1, 2, 4, 8), async_scheduling=True, **host)
    f = features_from_plan(decode_plan([500] * 4), 128)
    device = sum(t for op, t in sync.operator_times(f).items() if not op.startswith("host") and op != "swap")
    assert sync.predict(f) == pytest.approx(device + 2e-3)
    assert overlap.predict(f) == pytest.approx(max(device, 2e-3))


def test_shape_terms_only_add_time_and_keep_the_roofline_floor(llama_910b: CostModel) -> None:
    gemm = llama_910b.device.operators["gemm"]
    attn = llama_910b.device.operators["attn_decode"]
    shaped = _with_engine(
        llama_910b, gemm=dataclasses.replace(gemm, shape=64.0), attn_decode=dataclasses.replace(attn, shape=256.0)
    )
    for plan in (decode_plan([100] * 2), decode_plan([4000] * 64), prefill_plan(2048)):
        f = features_from_plan(plan, 128)
        plain, more = llama_910b.operator_times(f), shaped.operator_times(f)
        assert more["gemm"] >= plain["gemm"] and more["attn_decode"] >= plain["attn_decode"]
    small, large = (features_from_plan(prefill_plan(n), 128) for n in (512, 8192))  # both compute-bound
    work = lambda f: shaped.operator_work(f)["gemm"].flops / llama_910b.operator_work(f)["gemm"].flops  # noqa: E731
    assert work(small) == pytest.approx(1 + 64 / 512) and work(large) == pytest.approx(1 + 64 / 8192)
    ratio = lambda f: shaped.operator_times(f)["gemm"] / llama_910b.operator_times(f)["gemm"]  # noqa: E731
    assert ratio(small) > ratio(large) > 1


def _random_plans(rng: np.random.Generator, count: int) -> list[StepPlan]:
    plans = []
    for k in range(count):
        entries = [PlanEntry(f"d{i}", int(c), 1, False, True) for i, c in enumerate(rng.integers(0, 30_000, rng.integers(0, 300)))]
        entries += [PlanEntry(f"p{i}", int(rng.integers(0, 8000)), int(rng.integers(1, 4000)), True, bool(rng.integers(0, 2)))
                    for i in range(rng.integers(0, 4))]  # fmt: skip
        plans.append(StepPlan(step=k, entries=entries, copies=[(1, 2)] * int(rng.integers(0, 2))))
    return plans


@pytest.mark.parametrize("engine", ["graph", "eager", "async", "none", "none, row-count terms", "graph, MoE + MLA + W8A8",
                                    "graph, MoE with skewed routing"])
def test_one_step_predicts_bit_for_bit_what_the_array_path_does(llama_910b: CostModel, engine: str) -> None:
    """A step's prediction skips numpy and the per-operator dict on scalars; it must still be the
    very float the array path (the same formulas over many steps at once) gives for that step.
    The two forms of the roofline (CostModel._times, CostModel._one_step_times) are held together here alone."""
    host = {"host_step": OperatorCoefficients(call_s=3e-4), "host_seq": OperatorCoefficients(call_s=2e-6),
            "host_token": OperatorCoefficients(call_s=1e-7)}  # fmt: skip
    if engine.startswith("none"):
        device = dataclasses.replace(llama_910b.device, engine=None).with_operators(host)
        if engine.endswith("terms"):  # a CPU profile's shape: one matrix-vector product a row below 3 rows, terms at 1-3 rows
            device = dataclasses.replace(device, gemv_rows=3, row_count_s={1: 1e-3, 2: 2.5e-3, 3: 7e-4})
        cost = CostModel(llama_910b.model, device, 128)
    else:
        changes = {"mode": "eager", "dispatch_s": 2e-5} if engine == "eager" else {"async_scheduling": engine == "async"}
        cost = _with_engine(llama_910b, **changes, **host)
    if "MoE" in engine:
        model = load_model("deepseek-v2-lite", quantization="w8a8" if "W8A8" in engine else None)
        routing = ExpertRouting(model.num_experts, model.num_experts_per_tok, skew=0.8 if "skewed" in engine else 0.0)
        cost = CostModel(model, cost.device, 128, routing=routing)
    timer = CostModelTimer(cost)
    few = [decode_plan([100 * (k + 1)] * (k % 4 + 1), step=k) for k in range(12)]  # 1-4 tokens: the row-count terms' steps
    steps = [features_from_plan(p, 128) for p in _random_plans(np.random.default_rng(11), 300) + few]
    stacked = StepFeatures(**{name: np.array([getattr(f, name) for f in steps]) for name in FEATURE_NAMES})
    batched = cost.step_split(stacked)
    totals = cost.predict(stacked)
    for k, f in enumerate(steps):
        split = cost.step_split(f)
        assert list(split) == list(batched)
        assert all(split[op] == np.broadcast_to(batched[op], totals.shape)[k] for op in split), k
        assert cost.predict(f) == totals[k] == cost.step_total(f)
    plan = _random_plans(np.random.default_rng(12), 1)[0]
    assert timer.step(plan).duration_s == cost.step_time(plan) == cost.predict(features_from_plan(plan, 128))


def test_step_time_terms_add_in_order_on_every_python() -> None:
    """``sum()`` compensates float rounding since Python 3.12: a step added from plain floats must still
    round as the array path (numpy, element by element) and Python 3.11 do."""
    terms = [1e16, 1.0, -1e16]  # in order: 1e16 + 1 rounds to 1e16, so 0.0; compensated: 1.0
    assert in_order_sum(terms) == 0.0 == float(in_order_sum(np.array([t]) for t in terms)[0])
