"""The [engine] table of a device TOML: parsed strictly, written back equal."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvsim.sim.perf.device import load_device
from kvsim.sim.perf.engine_overhead import engine_toml_lines, parse_engine
from kvsim.sim.toml_io import load_toml


def test_engine_table_round_trips_with_the_v0_host_time(tmp_path: Path) -> None:
    engine = load_device("ascend-910b3").engine
    assert engine is not None and engine.v0_seq_s > 0 and engine.stream_s > 0  # fitted (docs/fidelity.md)
    path = tmp_path / "x.toml"
    path.write_text("\n".join(engine_toml_lines(engine)) + "\n")
    assert parse_engine(load_toml(path)["engine"], path) == engine


@pytest.mark.parametrize("value", [-1e-4, True, "fast"])
@pytest.mark.parametrize("key", ["v0_seq_s", "stream_s"])
def test_a_bad_host_time_names_file_and_field(key: str, value) -> None:
    table = {"mode": "eager", "dispatch_s": 1e-4, key: value}
    with pytest.raises(ValueError, match=rf"x\.toml: field engine\.{key} must be a number >= 0"):
        parse_engine(table, Path("x.toml"))


V1_DEFAULT_SIZES = (1, 2, 4, *range(8, 513, 8))  # vLLM's 67 capture sizes before v0.11


def test_acl_graph_keeps_the_sizes_vllm_ascend_computes_for_a_layout() -> None:
    """vllm-ascend v0.11.0's own worked example (its update_aclgraph_sizes comment): 48 layers under TP4
    with 1,920 streams keep 12 sizes; with the 1,800 it sets, 11. Sampled evenly, first and last kept."""
    engine = replace(load_device("ascend-910b3").engine, capture_sizes=V1_DEFAULT_SIZES, graph_stream_budget=1920)
    assert len(engine.for_run(256, 48, tensor_parallel_size=4).capture_sizes) == 12
    assert len(replace(engine, graph_stream_budget=1800).for_run(256, 48, tensor_parallel_size=4).capture_sizes) == 11
    # Six of the 67 sizes: those the vllm-ascend Q3 2025 roadmap thread (issue #1168) reports for Qwen3-235B on 8 NPUs
    six = replace(engine, graph_stream_budget=6 * 95 * 5 + 80).for_run(256, 94, tensor_parallel_size=8, data_parallel_size=2)
    assert six.capture_sizes == (1, 88, 192, 304, 408, 512) and six.capped_from == 67
    assert len(engine.for_run(256, 30).capture_sizes) == 61  # 1920 // 31 = 61 of 67
    assert engine.for_run(256, 27).capture_sizes == V1_DEFAULT_SIZES and engine.for_run(256, 27).capped_from == 0  # 1920 // 28 = 68


def test_the_stream_budget_binds_only_acl_graphs_in_graph_mode_and_too_small_a_budget_says_run_eagerly() -> None:
    engine = load_device("ascend-910b3").engine
    assert replace(engine, mode="eager").for_run(256, 200, 16, 2).capture_sizes == engine.capture_sizes
    assert load_device("h100-sxm").engine.for_run(256, 200, 16, 2) == load_device("h100-sxm").engine  # no budget
    with pytest.raises(ValueError, match=r"a 200-layer model under TP16 x DP2 leaves room for 1 ACL graph .*--enforce-eager"):
        engine.for_run(256, 200, 16, 2)


def test_a_run_on_ascend_pads_to_the_sizes_its_layout_keeps_and_its_summary_lists_them() -> None:
    from kvsim.sim.run.config import RunConfig, resolve

    deep = resolve(RunConfig(model="deepseek-v3", device="ascend-910b3", quantization="w8a8", tensor_parallel_size=8,
                             data_parallel_size=2, enable_expert_parallel=True, max_model_len=4096))
    assert deep.device.engine.capture_sizes == (1, 80, 184, 320, 512)  # (1800 - 80) // 62 // 5 = 5 of 51
    assert deep.device.engine.padded_tokens(2.0) == 80.0
    assert deep.to_dict()["resolved"]["graph_capture_sizes"] == [1, 80, 184, 320, 512]
    small = resolve(RunConfig(model="llama-2-7b", device="ascend-910b3"))  # 1800 // 33 = 54 >= 51: every size kept
    assert small.device.engine.capture_sizes == load_device("ascend-910b3").engine.capture_sizes
    assert "graph_capture_sizes" not in small.to_dict()["resolved"]


def test_a_run_captures_graphs_up_to_twice_its_max_num_seqs_as_vllm_does() -> None:
    """vLLM's default ceiling, min(2 max_num_seqs, 512): with 8 sequences the H100 keeps graphs of 1-16 tokens, and a
    step of 20 runs eagerly; the ceiling comes before ACL graph's budget, which then samples what is left."""
    from kvsim.sim.run.config import RunConfig, resolve

    h100 = load_device("h100-sxm").engine
    eight = h100.for_run(8, 32)
    assert eight.capture_sizes == (1, 2, 4, 8, 16) and eight.capped_from == 51
    assert eight.in_graph(16.0) and not eight.in_graph(20.0) and eight.padded_tokens(20.0) == 20.0
    assert h100.for_run(256, 32) == h100  # 512: every size
    executor = replace(h100, graph_sizes_per_seq=0)  # a calibrated profile lists what the executor captured: all kept
    assert executor.for_run(8, 32) == executor
    run = resolve(RunConfig(model="llama-3.1-8b", device="h100-sxm", max_num_seqs=8))
    assert run.to_dict()["resolved"]["graph_capture_sizes"] == [1, 2, 4, 8, 16]
    ascend = load_device("ascend-910b3").engine.for_run(64, 36)  # 128 first: 19 sizes, within the 48 that 36 layers hold
    assert ascend.capture_sizes[-1] == 128 and len(ascend.capture_sizes) == 19 and ascend.capped_from == 51


@pytest.mark.parametrize("key", ["graph_stream_budget", "moe_chunk_tokens"])
def test_a_bad_integer_field_names_file_and_field(key: str) -> None:
    with pytest.raises(ValueError, match=rf"x\.toml: field engine\.{key} must be an integer >= 0"):
        parse_engine({"mode": "eager", "dispatch_s": 1e-4, key: 1.5}, Path("x.toml"))


def test_the_cuda_devices_chunk_fused_moe_as_vllm_does_and_the_table_round_trips(tmp_path: Path) -> None:
    engine = load_device("h100-sxm").engine
    assert engine.moe_chunk_tokens == 32768 and load_device("ascend-910b3").engine.moe_chunk_tokens == 0
    path = tmp_path / "x.toml"
    path.write_text("\n".join(engine_toml_lines(engine)) + "\n")
    assert parse_engine(load_toml(path)["engine"], path) == engine
