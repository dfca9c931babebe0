"""Graph-capture memory (sim/perf/graph_memory.py): its terms, the device table, and `kvsim memory`'s report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvsim.cli.main import main
from kvsim.sim.parallel.layout import ParallelLayout, rank_model
from kvsim.sim.parallel.memory import rank_graph_capture
from kvsim.sim.perf.device import engine_as_run, load_device, save_device
from kvsim.sim.perf.graph_memory import GraphMemory, graph_capture
from kvsim.sim.perf.model_spec import load_model
from kvsim.sim.perf.vllm_release import estimates_graph_memory, parse_version, sampler_logit_bytes
from kvsim.sim.run.config import RunConfig, resolve

H100 = load_device("h100-sxm")
SIZES = H100.engine.capture_sizes  # vLLM's 51 default sizes up to 512
UNIT = GraphMemory(pool_bytes=1000.0, layer_bytes=10.0, moe_layer_bytes=3.0, split_accumulators=2.0)


def test_terms_follow_the_graphs_layers_and_heads_of_a_rank() -> None:
    llama = load_model("llama-3.1-8b")  # 32 layers, 32 heads of 128
    one = graph_capture(UNIT, llama, SIZES, max_num_seqs=1024)
    assert (one.piecewise_graphs, one.full_graphs, one.layers, one.moe_layers) == (51, 51, 32, 0)
    assert one.per_graph_bytes == 32 * 10 and one.pool_bytes == 1000
    assert one.accumulator_bytes == 2 * 512 * 32 * 128 * 4  # fp32 partials of every head, largest decode batch
    assert one.total_bytes == 1000 + 102 * 320 + one.accumulator_bytes
    tp4 = graph_capture(UNIT, rank_model(llama, ParallelLayout(4, 1, 1, False)), SIZES, max_num_seqs=1024)
    assert tp4.accumulator_bytes * 4 == one.accumulator_bytes and tp4.per_graph_bytes == one.per_graph_bytes
    pp4 = graph_capture(UNIT, rank_model(llama, ParallelLayout(1, 4, 1, False)), SIZES, max_num_seqs=1024)
    assert pp4.layers == 8 and pp4.accumulator_bytes == one.accumulator_bytes
    few = graph_capture(UNIT, llama, SIZES, max_num_seqs=64)
    assert few.full_graphs == SIZES.index(64) + 1 and few.accumulator_bytes * 8 == one.accumulator_bytes


def test_moe_layers_and_mla_latents_have_their_own_terms() -> None:
    moe = load_model("qwen3-30b-a3b")
    capture = graph_capture(UNIT, moe, SIZES, max_num_seqs=1024)
    assert capture.moe_layers == moe.num_moe_layers == 48 and capture.per_graph_bytes == 48 * (10 + 3)
    mla = load_model("deepseek-v2-lite")  # partial outputs of the latent (kv_lora_rank 512) per head
    latent = graph_capture(UNIT, mla, SIZES, max_num_seqs=1024)
    assert latent.accumulator_bytes == 2 * 512 * mla.num_heads * 512 * 4


def test_eager_runs_and_devices_without_the_table_capture_nothing() -> None:
    llama, one = load_model("llama-3.1-8b"), ParallelLayout(1, 1, 1, False)
    assert rank_graph_capture(H100, llama, one, 1024) is not None
    assert rank_graph_capture(engine_as_run(H100, enforce_eager=True), llama, one, 1024) is None
    assert rank_graph_capture(load_device("ascend-910b3"), llama, one, 1024) is None
    # a run's max_num_seqs cuts the sizes as vLLM's ceiling does: min(2 x 8, 512) = 16 tokens
    assert rank_graph_capture(H100, llama, one, 8).piecewise_graphs == SIZES.index(16) + 1


def test_the_gpu_siblings_take_the_h100_fit_and_a_saved_profile_keeps_it(tmp_path: Path) -> None:
    assert load_device("h200").graph_memory == H100.graph_memory is not None
    again = load_device(save_device(H100, tmp_path / "copy.toml"))
    assert again.graph_memory == H100.graph_memory


@pytest.mark.parametrize(("base", "table", "message"), [
    ("ascend-910b3", "layer_bytes = 1.0", "missing field graph_memory.pool_bytes"),  # a base with no table to merge into
    ("h100-sxm", "layer_bytes = -2.0", "field graph_memory.layer_bytes must be a number >= 0"),
    ("h100-sxm", "kernels = 3", "unknown field(s) graph_memory.kernels"),
])
def test_a_bad_graph_memory_table_names_the_file_and_field(tmp_path: Path, base: str, table: str, message: str) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(f'base = "{base}"\nname = "mine"\n\n[graph_memory]\n{table}\n')
    result = CliRunner().invoke(main, ["memory", "--model", "llama-3.1-8b", "--device", str(path)])
    assert result.exit_code == 2 and message in result.output and "mine.toml" in result.output


MEMORY = ["memory", "--model", "llama-3.1-8b", "--device", "h100-sxm", "--max-model-len", "8192"]


def test_kvsim_memory_reports_the_capture_beside_the_budget() -> None:
    result = CliRunner().invoke(main, [*MEMORY, "--gpu-memory-utilization", "0.95"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("graph capture"))
    assert "51 piecewise + 51 full graphs of 32 layers" in line and "3.96 GiB headroom" in line
    assert "warning" not in result.output
    plan = json.loads(CliRunner().invoke(main, [*MEMORY, "--json"]).output)
    expected = rank_graph_capture(H100, load_model("llama-3.1-8b"), ParallelLayout(1, 1, 1, False), 1024)
    assert plan["graph_capture"] == expected.to_dict()
    eager = CliRunner().invoke(main, [*MEMORY, "--enforce-eager"])
    assert "graph capture" not in eager.output
    assert json.loads(CliRunner().invoke(main, [*MEMORY, "--enforce-eager", "--json"]).output)["graph_capture"] is None


def test_kvsim_memory_warns_when_the_headroom_cannot_hold_the_capture() -> None:
    result = CliRunner().invoke(main, [*MEMORY, "--gpu-memory-utilization", "0.995"])
    assert result.exit_code == 0  # the pool is sized as vLLM sizes it; the capture is what would fail
    assert "warning: the graph capture needs" in result.output and "--enforce-eager" in result.output


def test_a_device_without_a_figure_says_so() -> None:
    result = CliRunner().invoke(main, ["memory", "--model", "qwen2.5-7b", "--device", "ascend-910b3"])
    assert "graph capture" in result.output and "no measured capture" in result.output


def test_from_v021_the_capture_comes_off_the_budget_before_the_pool() -> None:
    before = json.loads(CliRunner().invoke(main, [*MEMORY, "--json"]).output)
    after = json.loads(CliRunner().invoke(main, [*MEMORY, "--json", "--estimate-cudagraph-memory"]).output)
    capture = after["graph_capture"]["total_bytes"]
    assert before["graph_bytes"] == 0 and after["graph_bytes"] == capture
    assert after["kv_available_bytes"] == before["kv_available_bytes"] - capture
    assert after["num_blocks"] == after["kv_available_bytes"] // after["bytes_per_block"] < before["num_blocks"]
    text = CliRunner().invoke(main, [*MEMORY, "--estimate-cudagraph-memory"]).output
    assert "  graph capture" in text and "taken off the budget first (vLLM v0.21+)" in text and "headroom" not in text


def test_the_switch_reaches_a_simulated_run_and_is_refused_where_no_figure_exists(tmp_path: Path) -> None:
    base = RunConfig(trace="demo", model="llama-3.1-8b", device="h100-sxm", max_model_len=8192)
    plain, budgeted = resolve(base).memory, resolve(RunConfig(**{**base.to_dict(), "estimate_cudagraph_memory": True})).memory
    assert budgeted.graph_bytes > 0 and budgeted.num_blocks < plain.num_blocks and plain.graph_bytes == 0
    eager = resolve(RunConfig(**{**base.to_dict(), "estimate_cudagraph_memory": True, "enforce_eager": True})).memory
    assert eager.graph_bytes == 0 and eager.num_blocks == plain.num_blocks  # vLLM captures nothing eagerly
    result = CliRunner().invoke(main, ["simulate", "--trace", "demo", "--model", "qwen2.5-7b", "--device", "ascend-910b3",
                                       "--estimate-cudagraph-memory", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "no [graph_memory] figure" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_release_sets_the_samplers_peak_and_from_021_the_graph_estimate() -> None:
    assert parse_version("0.19.0") == (0, 19) and parse_version("v0.11") == (0, 11) and parse_version("0.21.0rc1") == (0, 21)
    with pytest.raises(ValueError, match="vllm_version must be a vLLM release"):
        parse_version("latest")
    assert sampler_logit_bytes("") == 8.0 and sampler_logit_bytes("0.16.0") == 38.4 and sampler_logit_bytes("0.17.0") == 14.9
    assert not estimates_graph_memory("0.20.1") and estimates_graph_memory("0.21.0") and not estimates_graph_memory("")
    qwen = ["memory", "--model", "qwen2.5-7b", "--device", "h100-sxm", "--max-model-len", "8192", "--json"]
    plans = {v: json.loads(CliRunner().invoke(main, [*qwen, "--vllm-version", v]).output) for v in ("0.11.0", "0.19.0", "0.21.0")}
    default = json.loads(CliRunner().invoke(main, qwen).output)
    # 1,024 sampled rows of Qwen's 152,064-entry vocabulary at 38.4 and 14.9 bytes, and kvsim's own 8 where no
    # release is named (the bundled H100's case); the final hidden states on top
    hidden = 2 * 8192 * 3584
    assert default["activation_bytes"] == hidden + 8 * 1024 * 152064
    assert plans["0.11.0"]["activation_bytes"] == hidden + round(38.4 * 1024 * 152064)
    assert plans["0.19.0"]["activation_bytes"] == hidden + round(14.9 * 1024 * 152064)
    assert plans["0.19.0"]["graph_bytes"] == 0 and plans["0.21.0"]["graph_bytes"] == plans["0.21.0"]["graph_capture"]["total_bytes"]
    off = json.loads(CliRunner().invoke(main, [*qwen, "--vllm-version", "0.21.0", "--no-estimate-cudagraph-memory"]).output)
    assert off["graph_bytes"] == 0 and off["num_blocks"] == plans["0.19.0"]["num_blocks"]


def test_a_release_is_refused_off_cuda_and_a_bad_one_in_a_device_file_is_named(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["memory", "--model", "qwen2.5-7b", "--device", "ascend-910b3", "--vllm-version", "0.19.0"])
    assert result.exit_code == 2 and "release rules are vLLM's on CUDA devices" in result.output
    path = tmp_path / "mine.toml"
    path.write_text('base = "h100-sxm"\nname = "mine"\n\n[engine]\nvllm_version = "next"\n')
    bad = CliRunner().invoke(main, ["memory", "--model", "qwen2.5-7b", "--device", str(path)])
    assert bad.exit_code == 2 and "mine.toml" in bad.output and "engine.vllm_version must be a vLLM release" in bad.output
    named = tmp_path / "v19.toml"
    named.write_text('base = "h100-sxm"\nname = "v19"\n\n[engine]\nvllm_version = "0.19.0"\n')
    assert load_device(named).engine.vllm_version == "0.19.0"
    assert load_device(save_device(load_device(named), tmp_path / "again.toml")).engine.vllm_version == "0.19.0"
