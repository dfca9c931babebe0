"""What MoE, MLA and W8A8 change in a step's cost: expert reads by distinct experts, latent KV reads, int8 GEMMs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsim.sim.perf.cost_model import CostModel, StepFeatures
from kvsim.sim.perf.device import load_device, save_device
from kvsim.sim.perf.expert_routing import ExpertRouting
from kvsim.sim.perf.memory import plan_memory
from kvsim.sim.perf.model_spec import load_model

DEVICE = load_device("ascend-910b3")
FEATURE_NAMES = [f.name for f in dataclasses.fields(StepFeatures)]


def _step(tokens: float, decode_seqs: float = 0.0, context: float = 1024.0) -> StepFeatures:
    """A decode step of ``decode_seqs`` sequences at ``context``, or one prefill of ``tokens`` tokens."""
    values = dict.fromkeys(FEATURE_NAMES, 0.0)
    if decode_seqs:
        values.update(num_tokens=decode_seqs, num_seqs=decode_seqs, num_sampled=decode_seqs, decode_seqs=decode_seqs,
                      decode_ctx_tokens=decode_seqs * context, blocks_touched=decode_seqs * context / 128)
    else:
        values.update(num_tokens=tokens, num_seqs=1.0, num_sampled=1.0, prefill_tokens=tokens, prefill_ctx_tokens=tokens,
                      attn_pairs=tokens * (tokens + 1) / 2, blocks_touched=tokens / 128)
    return StepFeatures(**values)


def test_uniform_routing_touches_top_k_for_one_token_and_nearly_all_for_many() -> None:
    routing = ExpertRouting(num_experts=128, top_k=8)
    assert routing.distinct_experts(1.0) == pytest.approx(8.0)
    counts = routing.distinct_experts(np.array([1.0, 8.0, 64.0, 4096.0]))
    assert np.all(np.diff(counts) > 0) and counts[-1] == pytest.approx(128.0)
    assert 8 < counts[1] < 64  # 8 tokens x top-8 overlap: fewer than 64 distinct experts
    skewed = ExpertRouting(num_experts=128, top_k=8, skew=1.0)
    assert skewed.pick_probabilities.sum() == pytest.approx(8.0) and skewed.pick_probabilities.max() <= 1.0
    assert skewed.distinct_experts(8.0) < routing.distinct_experts(8.0)  # popular experts are shared more
    assert skewed.distinct_experts(np.array([8.0]))[0] == pytest.approx(skewed.distinct_experts(8.0))


def test_routing_rejects_top_k_above_the_expert_count() -> None:
    with pytest.raises(ValueError, match="top-k 9"):
        ExpertRouting(num_experts=8, top_k=9)


def test_a_decode_step_reads_far_fewer_expert_weights_than_a_long_prefill() -> None:
    model = load_model("qwen3-30b-a3b")
    cost = CostModel(model, DEVICE, 128)
    expert_bytes = model.expert_params() * model.num_moe_layers * 2  # one expert of every MoE layer, bf16
    decode = cost.operator_work(_step(0, decode_seqs=8))["moe"].bytes
    prefill = cost.operator_work(_step(4096))["moe"].bytes
    assert 8 * expert_bytes < decode < 64 * expert_bytes  # neither one expert nor all 128
    assert prefill > 127 * expert_bytes  # a 4,096-token prefill touches essentially every expert
    assert prefill / decode > 2


def test_a_tokens_expert_activations_include_the_combine_of_its_k_outputs() -> None:
    """Each of a token's k copies goes in and out of two grouped matmuls (h in, 2I out; I in, h out), and the
    combine that ends vLLM's fused experts (moe_sum; vllm-ascend's finalize-routing) reads the k outputs again
    and writes their sum: per token and MoE layer k (2h + 3I) + (k + 1) h values beyond the expert weights."""
    model = load_model("qwen3-30b-a3b")
    cost = CostModel(model, DEVICE, 128)
    small, large = 8192.0, 16384.0  # both touch every expert, so the weight reads are equal
    moved = cost.operator_work(_step(large))["moe"].bytes - cost.operator_work(_step(small))["moe"].bytes
    h, inter, k = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok
    per_token = model.num_moe_layers * (k * (2 * h + 3 * inter) + (k + 1) * h) * 2  # bf16
    assert moved == pytest.approx((large - small) * per_token, rel=1e-6)


def test_dense_models_have_no_moe_work_and_moe_models_no_dense_mlp_in_gemm() -> None:
    dense = CostModel(load_model("qwen3-32b"), DEVICE, 128).operator_work(_step(512))
    assert dense["moe"] == (0.0, 0.0, 0)
    moe_model = load_model("qwen3-30b-a3b")
    gemm = CostModel(moe_model, DEVICE, 128).operator_work(_step(1.0))["gemm"]
    per_token = moe_model.per_token_matmul_params()
    assert gemm.flops == pytest.approx(2 * per_token)  # attention + router, no expert
    assert per_token < 0.1 * moe_model.param_counts().routed_experts


def test_mla_decode_reads_the_latent_not_per_head_kv() -> None:
    model = load_model("deepseek-v2-lite")
    cost = CostModel(model, DEVICE, 128)
    long, short = (cost.operator_work(_step(0, decode_seqs=8, context=ctx))["attn_decode"] for ctx in (8192.0, 1024.0))
    per_token_layer = (long.bytes - short.bytes) / (8 * 7168 * model.num_layers)
    assert per_token_layer == pytest.approx(576 * 2)  # 512 latent + 64 rope key, bf16: 1,152 bytes
    # the same heads with per-head K and V (16 heads x (192 + 128)) would read 10,240 bytes
    assert model.kv_bytes_per_token() == 27 * 576 * 2


def test_mla_prefill_pays_the_up_projection_of_every_cached_token() -> None:
    model = load_model("deepseek-v2-lite")
    cost = CostModel(model, DEVICE, 128)
    fresh = cost.operator_work(_step(2048))["attn_prefill"]
    cached = cost.operator_work(StepFeatures(**{**vars(_step(2048)), "prefill_ctx_tokens": 2048.0 + 8192.0}))["attn_prefill"]
    up = 2 * model.mla_up_projection_params() * 8192 * model.num_layers
    assert cached.flops - fresh.flops == pytest.approx(up)


def test_w8a8_runs_gemms_at_the_int8_rate_and_reads_half_the_weights() -> None:
    bf16 = CostModel(load_model("qwen3-32b"), DEVICE, 128)
    w8a8 = CostModel(load_model("qwen3-32b", quantization="w8a8"), DEVICE, 128)
    assert w8a8.roofs("gemm")[0] == DEVICE.matrix_flops["int8"] and w8a8.roofs("lm_head")[0] == DEVICE.matrix_flops["bf16"]
    prefill, decode = _step(4096), _step(0, decode_seqs=1)
    assert w8a8.operator_times(prefill)["gemm"] == pytest.approx(bf16.operator_times(prefill)["gemm"] / 2, rel=0.02)
    assert w8a8.operator_work(decode)["gemm"].bytes < 0.55 * bf16.operator_work(decode)["gemm"].bytes
    assert w8a8.operator_work(decode)["elementwise"].bytes > bf16.operator_work(decode)["elementwise"].bytes  # quantising


def test_mla_and_int8_kv_hold_more_tokens_in_the_same_memory() -> None:
    lite = load_model("deepseek-v2-lite")
    plan = plan_memory(lite, DEVICE, max_model_len=32768)
    int8 = plan_memory(lite, DEVICE, kv_dtype="int8", max_model_len=32768)
    assert plan.bytes_per_block == 128 * 27 * 576 * 2 and int8.bytes_per_block * 2 == plan.bytes_per_block
    assert int8.num_blocks > 1.9 * plan.num_blocks


def test_a_moe_table_inherits_the_keys_it_leaves_out_from_gemm(tmp_path) -> None:
    """ascend-910b3 sets only the MoE layer's kernel count and group_flops: the efficiencies and
    launch cost stay the GEMM's; h100-sxm sets only the efficiencies; a device without the table
    prices MoE as GEMM with the generic count."""
    moe, gemm = DEVICE.operators["moe"], DEVICE.operators["gemm"]
    assert (moe.compute_efficiency, moe.memory_efficiency, moe.call_s) == (gemm.compute_efficiency, gemm.memory_efficiency, gemm.call_s)
    assert moe.launches == 15 and moe.group_flops > 0 and moe.shape == 0
    plain = load_device("rtx-3090")
    assert plain.operators["moe"] == plain.operators["gemm"] and plain.operators["moe"].launches is None
    h100 = load_device("h100-sxm")  # sets the efficiencies only: its GEMM's are a dense serving fit
    moe, gemm = h100.operators["moe"], h100.operators["gemm"]
    assert (moe.compute_efficiency, moe.memory_efficiency) == (0.80, 0.90) != (gemm.compute_efficiency, gemm.memory_efficiency)
    assert (moe.call_s, moe.shape, moe.launches) == (gemm.call_s, gemm.shape, None)
    path = save_device(DEVICE, tmp_path / "d.toml")
    assert load_device(path) == DEVICE
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text().replace("launches = 15", "launches = 1.5"))
    with pytest.raises(ValueError, match=r"operators\.moe\.launches must be an integer"):
        load_device(bad)


def test_w8a8_matrix_work_runs_at_its_own_share_of_the_int8_peak(tmp_path) -> None:
    """An engine's 8-bit expert path need not reach the 16-bit path's share of a doubled peak: h100-sxm's MoE
    table fits its own (``w8a8_compute_efficiency``). It prices only a W8A8 model's grouped matmuls there; the
    dense GEMMs keep theirs, and a BF16 model never reads it."""
    h100 = load_device("h100-sxm")
    assert h100.operators["moe"].w8a8_compute_efficiency is not None and h100.operators["gemm"].w8a8_compute_efficiency is None
    # Shares low enough that the step is compute-bound at either (the bundled 8-bit share sits where it is not).
    moe = dataclasses.replace(h100.operators["moe"], compute_efficiency=0.5, w8a8_compute_efficiency=0.25)
    own = h100.with_operators({"moe": moe})
    plain = h100.with_operators({"moe": dataclasses.replace(moe, w8a8_compute_efficiency=None)})
    prefill = _step(16384)  # 1024 rows an expert
    fp8 = load_model("qwen3-30b-a3b", quantization="w8a8")
    fitted, unfitted = CostModel(fp8, own, 16).operator_times(prefill), CostModel(fp8, plain, 16).operator_times(prefill)
    assert fitted["moe"] == pytest.approx(unfitted["moe"] * 2, rel=0.01)  # half the share; the same launches
    assert fitted["gemm"] == unfitted["gemm"]
    bf16 = load_model("qwen3-30b-a3b")
    assert CostModel(bf16, own, 16).operator_times(prefill) == CostModel(bf16, plain, 16).operator_times(prefill)
    path = save_device(h100, tmp_path / "h.toml")
    assert load_device(path) == h100
    # An inherited table that sets its own compute efficiency does not take the parent's 8-bit one with it.
    text = path.read_text().replace("[operators.gemm]\n", "[operators.gemm]\nw8a8_compute_efficiency = 0.2\n")
    bundled = h100.operators["moe"].w8a8_compute_efficiency
    (tmp_path / "g.toml").write_text(text.replace(f"w8a8_compute_efficiency = {bundled}\n", ""))
    edited = load_device(tmp_path / "g.toml")
    assert edited.operators["gemm"].w8a8_compute_efficiency == 0.2 and edited.operators["moe"].w8a8_compute_efficiency is None
    (tmp_path / "bad.toml").write_text(text.replace("w8a8_compute_efficiency = 0.2", "w8a8_compute_efficiency = 0"))
    with pytest.raises(ValueError, match=r"operators\.gemm\.w8a8_compute_efficiency must be > 0"):
        load_device(tmp_path / "bad.toml")


def test_a_grouped_matmuls_fixed_cost_per_group_does_not_grow_with_the_expert() -> None:
    """group_flops is work per touched expert whatever its size; half_tokens is rows of that expert. Fitted as
    rows on Qwen3-30B-A3B at TP2 (a 2.4M-weight slice), the 910B3's term cost DeepSeek-V3's whole 44M-weight
    experts 19x as much; as a fixed cost it costs both the same."""
    qwen, deepseek = load_model("qwen3-30b-a3b"), load_model("deepseek-v3")
    per_group = DEVICE.operators["moe"].group_flops
    rows = DEVICE.with_operators({"moe": dataclasses.replace(DEVICE.operators["moe"], group_flops=0.0,
                                                             shape=per_group / (2 * deepseek.expert_params()))})
    none = DEVICE.with_operators({"moe": dataclasses.replace(DEVICE.operators["moe"], group_flops=0.0)})
    step = _step(0, decode_seqs=4)

    def added(model, device) -> float:
        return CostModel(model, device, 128).operator_work(step)["moe"].flops - CostModel(model, none, 128).operator_work(step)["moe"].flops

    touched = ExpertRouting(num_experts=256, top_k=8).distinct_experts(4.0) * deepseek.num_moe_layers
    touched_qwen = ExpertRouting(num_experts=128, top_k=8).distinct_experts(4.0) * qwen.num_moe_layers
    assert added(deepseek, DEVICE) == pytest.approx(per_group * touched)
    assert added(qwen, DEVICE) == pytest.approx(per_group * touched_qwen)  # the same work a touched expert
    assert added(deepseek, rows) == pytest.approx(added(deepseek, DEVICE))  # the same work on the expert it was sized on
    assert added(qwen, rows) < added(qwen, DEVICE) / 8  # but rows shrink with a smaller expert (9.3x smaller)


def test_the_moe_layers_kernel_count_is_what_eager_dispatch_pays() -> None:
    """In eager mode a small decode step is dispatch-bound: each MoE layer's extra kernels cost one dispatch each."""
    model = load_model("qwen3-30b-a3b")
    generic = DEVICE.with_operators({"moe": dataclasses.replace(DEVICE.operators["moe"], launches=None)})
    counted = CostModel(model, DEVICE, 128).operator_work(_step(0, decode_seqs=4))["moe"].calls
    assert counted == 15 * model.num_moe_layers
    assert CostModel(model, generic, 128).operator_work(_step(0, decode_seqs=4))["moe"].calls == 6 * model.num_moe_layers


def test_an_expert_parallel_ranks_elementwise_work_is_its_share_of_the_expert_copies() -> None:
    """Under EP a rank activates k / EP of a token's k expert copies (uniform routing), not the top-k of its local
    experts that its rank model keeps: Qwen3-30B-A3B at EP8 runs 1 of each token's 8 copies on a rank."""
    from kvsim.sim.parallel.layout import ParallelLayout
    from kvsim.sim.parallel.rank_cost import ParallelCostModel

    model = load_model("qwen3-30b-a3b")
    rank = ParallelCostModel(model, DEVICE, ParallelLayout(tensor_parallel_size=8, enable_expert_parallel=True), 128).rank
    local_top_k = CostModel(rank.model, DEVICE, 128)  # the rank's spec on its own: top-8 of its 16 experts
    assert (rank.model.num_experts, rank.model.num_experts_per_tok, rank.routing.busiest_rank(1.0)[0]) == (16, 8, 1.0)
    tokens = 1000.0
    saved = local_top_k.operator_work(_step(tokens))["elementwise"].bytes - rank.operator_work(_step(tokens))["elementwise"].bytes
    per_copy = 3 * model.num_moe_layers * rank.model.moe_intermediate_size * 2  # in, activated, out; bf16
    assert saved == pytest.approx(tokens * (8 - 1) * per_copy)
    one_device = CostModel(model, DEVICE, 128)
    assert one_device.routing.busiest_rank(1.0)[0] == 8.0  # one device: every copy
