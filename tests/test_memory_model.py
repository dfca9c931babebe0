"""Memory model: the vLLM sizing rule term by term, int8 KV, misfits, and the `kvsim memory` command."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvsim.cli.memory import memory
from kvsim.sim.perf.device import DEVICES_DIR, load_device
from kvsim.sim.perf.memory import (
    ModelDoesNotFit,
    activation_workspace_bytes,
    block_size_default,
    plan_memory,
    scheduler_defaults,
)
from kvsim.sim.perf.model_spec import DTYPE_BYTES, load_model
from kvsim.sim.run.config import RunConfig, resolve


def test_block_count_follows_vllm_sizing_exactly() -> None:
    model, device = load_model("llama-3-8b"), load_device("ascend-910b3")
    plan = plan_memory(model, device, block_size=128, memory_utilization=0.85, max_num_batched_tokens=4096)
    budget = math.ceil(device.hbm_bytes * 0.85)
    available = budget - model.weight_bytes() - activation_workspace_bytes(model, 4096, 256) - device.runtime_reserve_bytes
    # 2 (K,V) x 32 layers x 128 tokens x 8 kv heads x 128 dims x 2 bytes = 16 MiB.
    assert plan.bytes_per_block == 2 * 32 * 128 * 8 * 128 * 2 == 16 * 2**20
    assert plan.kv_bytes_per_token * 128 == plan.bytes_per_block
    assert plan.budget_bytes == budget and plan.kv_available_bytes == available
    assert plan.num_blocks == available // plan.bytes_per_block
    terms = plan.weight_bytes + plan.activation_bytes + plan.reserve_bytes + plan.kv_pool_bytes + plan.unused_bytes
    assert terms == plan.budget_bytes
    assert 0 <= plan.unused_bytes < plan.bytes_per_block and plan.fits


def test_activation_workspace_formula_by_hand() -> None:
    tiny = load_model("tiny")  # fp32, h 256, q 256, kv 128, I 688, V 4096
    in_layer = 4 * 512 * (3 * 256 + max(2 * 256 + 2 * 128, 3 * 688))
    at_head = 4 * 512 * 256 + 2 * 4 * 64 * 4096
    assert activation_workspace_bytes(tiny, 512, 64) == max(in_layer, at_head) == in_layer
    # Few tokens but many sampled rows: the logits dominate, and rows are capped by the tokens.
    assert activation_workspace_bytes(tiny, 8, 256) == 4 * 8 * 256 + 2 * 4 * 8 * 4096


def test_an_moe_layer_that_gathers_holds_every_members_tokens_up_to_its_chunk() -> None:
    moe = load_model("small-moe")
    h, a = moe.hidden_size, DTYPE_BYTES[moe.activation_dtype]
    per_copy = moe.num_experts_per_tok * (h + 3 * moe.moe_intermediate_size) + 3 * moe.shared_expert_intermediate_size
    own = activation_workspace_bytes(moe, 512, 1)
    assert activation_workspace_bytes(moe, 512, 1, moe_tokens=512, moe_chunk_tokens=4096) == own  # nothing gathered
    # Four members' 512 tokens: the per-copy workspace for all 2048, plus the gathered inputs and combined outputs.
    four = a * 512 * 3 * h + a * (2048 * per_copy + 2 * 2048 * h)
    assert activation_workspace_bytes(moe, 512, 1, moe_tokens=2048) == four > own
    # A 1024-token chunk holds workspace for half of them; the exchange buffers stay whole.
    assert activation_workspace_bytes(moe, 512, 1, moe_tokens=2048, moe_chunk_tokens=1024) == (
        a * 512 * 3 * h + a * (1024 * per_copy + 2 * 2048 * h))


def test_int8_kv_nearly_doubles_the_blocks() -> None:
    model, device = load_model("llama-3-8b"), load_device("h100-sxm")
    bf16 = plan_memory(model, device, kv_dtype="bf16")
    int8 = plan_memory(model, device, kv_dtype="int8")
    # Per token, layer and KV head: bf16 2 x 128 x 2 = 512 bytes; int8 2 x 128 = 256. The static
    # per-channel scales (C8) are 2 x layers x kv_heads x head_dim fp32 once, outside the blocks.
    assert Fraction(bf16.kv_bytes_per_token, int8.kv_bytes_per_token) == 2
    assert int8.kv_scale_bytes == 2 * 32 * 8 * 128 * 4 and bf16.kv_scale_bytes == 0
    assert int8.kv_available_bytes == bf16.kv_available_bytes - int8.kv_scale_bytes
    assert int8.num_blocks == int8.kv_available_bytes // int8.bytes_per_block
    assert int8.num_blocks / bf16.num_blocks == pytest.approx(2, rel=2 / bf16.num_blocks)


def test_max_sequences_rounds_each_sequence_up_to_whole_blocks() -> None:
    plan = plan_memory(load_model("llama-2-7b"), load_device("ascend-910b3"), block_size=128)
    assert plan.max_sequences(4096) == plan.num_blocks // 32
    assert plan.max_sequences(4097) == plan.num_blocks // 33
    assert plan.max_sequences(1) == plan.num_blocks
    with pytest.raises(ValueError, match="seq_len must be positive"):
        plan.max_sequences(0)


def test_more_workspace_or_less_utilization_means_fewer_blocks() -> None:
    model, device = load_model("qwen2.5-7b"), load_device("ascend-910b2")
    by_tokens = [plan_memory(model, device, max_num_batched_tokens=t, max_model_len=32768).num_blocks for t in (512, 2048, 8192, 32768)]
    assert by_tokens == sorted(by_tokens, reverse=True) and by_tokens[0] > by_tokens[-1]
    by_util = [plan_memory(model, device, memory_utilization=u, max_model_len=32768).num_blocks for u in (0.5, 0.7, 0.9, 1.0)]
    assert by_util == sorted(by_util) and by_util[0] < by_util[-1]


def test_a_model_that_does_not_fit_is_a_result_not_a_crash() -> None:
    model, device = load_model("llama-2-13b"), load_device("ascend-910b4")
    plan = plan_memory(model, device, memory_utilization=0.7)
    assert not plan.fits and plan.num_blocks == 0 and plan.kv_available_bytes < 0
    assert plan.max_sequences(4096) == 0
    assert "does not fit on ascend-910b4" in plan.problem and "24.24 GiB" in plan.problem
    assert plan.problem.endswith("the weights alone exceed it: split the weights over more devices (tensor_parallel_size) "
                                 "or quantize them (quantization w8a8 or w8a8_dynamic)")
    tight = plan_memory(model, device, memory_utilization=0.77)  # the weights fit, the rest does not
    assert tight.weight_bytes < tight.budget_bytes and not tight.fits
    assert tight.problem.endswith("; lower max_num_batched_tokens, raise memory_utilization or split the weights over "
                                  "more devices (tensor_parallel_size)")
    with pytest.raises(ModelDoesNotFit, match="does not fit"):
        plan.require_fit()
    assert plan_memory(model, device, memory_utilization=0.9).require_fit().num_blocks > 0


def test_a_pool_smaller_than_one_max_length_sequence_is_reported() -> None:
    model, device = load_model("llama-2-13b"), load_device("ascend-910b4")
    plan = plan_memory(model, device, memory_utilization=0.82)  # weights fit, the pool holds < 4096 tokens
    assert plan.kv_available_bytes > 0 and 0 < plan.token_capacity < 4096
    assert not plan.fits and "fewer than one max_model_len (4096)" in plan.problem
    assert plan_memory(model, device, memory_utilization=0.82, max_model_len=plan.token_capacity).fits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block_size must be positive"),
        ({"memory_utilization": 1.5}, r"memory_utilization must be in \(0, 1\]"),
        ({"max_model_len": 5000}, r"max_model_len must be in \[1, 4096\]"),
        ({"kv_dtype": "fp8"}, "unknown kv_dtype 'fp8'"),
        ({"max_num_seqs": 0}, "must be positive"),
    ],
)
def test_bad_inputs_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_memory(load_model("llama-2-7b"), load_device("cpu"), **kwargs)


def test_cli_prints_the_breakdown() -> None:
    result = CliRunner().invoke(memory, ["--model", "llama-2-7b", "--device", "ascend-910b3", "--seq-len", "2048"])
    assert result.exit_code == 0, result.output
    plan = plan_memory(load_model("llama-2-7b"), load_device("ascend-910b3"))
    assert f"{plan.num_blocks} blocks x 64.00 MiB" in result.output
    assert "KV bytes per token" in result.output and "512.00 KiB" in result.output
    assert "sequences of 2048" in result.output and f"{plan.max_sequences(2048)}" in result.output
    assert "KV scales" not in result.output  # fp16 carries none


def test_cli_shows_the_int8_scales_beside_the_pool() -> None:
    result = CliRunner().invoke(memory, ["--model", "llama-2-7b", "--device", "ascend-910b3", "--kv-cache-dtype", "int8"])
    assert result.exit_code == 0, result.output
    plan = plan_memory(load_model("llama-2-7b"), load_device("ascend-910b3"), kv_dtype="int8")
    assert plan.kv_scale_bytes > 0
    assert "KV scales                 1.00 MiB" in result.output and f"{plan.num_blocks} blocks x 32.00 MiB" in result.output


def test_cli_json_matches_the_plan() -> None:
    """Without --max-num-seqs the CLI samples vLLM's 1024 rows on an H200 (scheduler_defaults), not the 256 below 70 GiB."""
    args = ["--model", "llama-3-8b", "--device", "h200", "--kv-dtype", "int8", "--block-size", "64",
            "--max-model-len", "4096", "--memory-utilization", "0.8", "--max-num-batched-tokens", "8192", "--json"]
    result = CliRunner().invoke(memory, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    plan = plan_memory(load_model("llama-3-8b"), load_device("h200"), kv_dtype="int8", block_size=64,
                       max_model_len=4096, memory_utilization=0.8, max_num_batched_tokens=8192, max_num_seqs=1024)
    assert data["num_blocks"] == plan.num_blocks and data["fits"] is True
    assert data["max_sequences"] == plan.max_sequences(4096) and data["seq_len"] == 4096


def test_cli_exits_nonzero_when_the_model_does_not_fit() -> None:
    result = CliRunner().invoke(memory, ["--model", "llama-2-13b", "--device", "ascend-910b4", "--memory-utilization", "0.7"])
    assert result.exit_code == 1
    assert "does not fit on ascend-910b4" in result.output


def test_cli_reads_a_device_file_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (DEVICES_DIR / "ascend-910b3.toml").read_text().replace("hbm_bytes = 68719476736", "hbm_bytes = 137438953472")
    (tmp_path / "bigbox.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(memory, ["--model", "llama-2-7b", "--device", "bigbox", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["total_bytes"] == 2**37
    bad = CliRunner().invoke(memory, ["--model", "llama-2-7b", "--device", "nosuch"])
    assert bad.exit_code != 0 and "unknown device 'nosuch'" in bad.output


@pytest.mark.parametrize("device, tokens, seqs", [("h100-sxm", 8192, 1024), ("h200", 8192, 1024), ("a100-sxm", 2048, 256),
                                                  ("ascend-910b3", 2048, 256), ("ascend-910c", 2048, 256),
                                                  ("rtx-3090", 2048, 256)])
def test_scheduler_defaults_follow_vllms_rule_for_the_device(device: str, tokens: int, seqs: int) -> None:
    """vLLM's OpenAI server: 8192 tokens and 1024 sequences on a GPU of 70 GiB or more, but not an A100 (#17885);
    2048 and 256 elsewhere, and on Ascend, whose platform reports no memory to the rule."""
    assert scheduler_defaults(load_device(device)) == (tokens, seqs)
    run = resolve(RunConfig(model="qwen3-8b", device=device, max_model_len=4096))
    assert (run.config.max_num_batched_tokens, run.config.max_num_seqs) == (tokens, seqs)
    assert (run.engine_config.max_num_batched_tokens, run.engine_config.max_num_seqs) == (tokens, seqs)
    given = resolve(RunConfig(model="qwen3-8b", device=device, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=512))
    assert (given.engine_config.max_num_batched_tokens, given.engine_config.max_num_seqs) == (512, 64)


@pytest.mark.parametrize("device, model, block", [("h100-sxm", "qwen3-8b", 16), ("a100-sxm", "qwen3-8b", 16), ("rtx-3090", "qwen3-8b", 16),
                                                  ("h200", "small-mla", 64), ("a100-sxm", "small-mla", 16),
                                                  ("ascend-910b3", "qwen3-8b", 128), ("ascend-910b3", "small-mla", 128),
                                                  ("cpu", "tiny", 128)])
def test_the_block_size_default_is_vllms_on_the_device(device: str, model: str, block: int) -> None:
    """vLLM's CUDA platform: 16, and 64 where FlashMLA serves an MLA model (Hopper only); vllm-ascend: 128."""
    assert block_size_default(load_device(device), load_model(model)) == block
    run = resolve(RunConfig(model=model, device=device, max_model_len=4096))
    assert run.config.block_size == run.engine_config.block_size == block
    assert resolve(RunConfig(model=model, device=device, max_model_len=4096, block_size=32)).engine_config.block_size == 32


@pytest.mark.parametrize("base, model, block, budget", [("ascend-910b3", "qwen3-8b", 128, (2048, 256)),
                                                        ("h200", "small-mla", 64, (8192, 1024)),
                                                        ("a100-sxm", "qwen3-8b", 16, (2048, 256)),
                                                        ("cpu", "tiny", 128, (2048, 256))])
def test_a_what_if_device_of_any_name_takes_the_defaults_of_its_platform(
        base: str, model: str, block: int, budget: tuple[int, int], tmp_path: Path) -> None:
    """vLLM's rules read the device file's platform and generation, not its name: a 910B3 with faster HBM named
    "fast-hbm" stays an Ascend part (block 128, vllm-ascend's budget), where a name test took it for a GPU."""
    (tmp_path / "fast-hbm.toml").write_text(f'base = "{base}"\nhbm_bandwidth = 9e12\n')
    device = load_device("fast-hbm", search_dirs=[tmp_path])
    assert (block_size_default(device, load_model(model)), scheduler_defaults(device)) == (block, budget)
    run = resolve(RunConfig(model=model, device="fast-hbm", max_model_len=4096), search_dirs=(tmp_path,))
    assert (run.engine_config.block_size, run.engine_config.max_num_batched_tokens) == (block, budget[0])
