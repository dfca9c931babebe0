"""vLLM's engine-argument names on the command line and in TOML, kvsim's old names as hidden
aliases giving the same run, and vLLM bench's --request-rate realised on the trace."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvsim.cli.main import main
from kvsim.sim.run.config import RunConfig, load_run_config, load_run_trace, resolve

VLLM = ["--kv-cache-dtype", "int8", "--gpu-memory-utilization", "0.8", "--num-gpu-blocks-override", "60",
        "--no-enable-prefix-caching", "--request-rate", "2", "--block-size", "16"]
OLD = ["--kv-dtype", "int8", "--memory-utilization", "0.8", "--num-blocks", "60",
       "--block-manager", "paged", "--rate-scale", "RATIO", "--block-size", "16"]


def _summary(tmp_path, name: str, args: list[str]) -> dict:
    result = CliRunner().invoke(main, ["simulate", "--trace", "demo", "--quiet", "--out", str(tmp_path / name), *args])
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / name / "summary.json").read_text())


def test_vllm_names_and_old_aliases_give_the_same_run(tmp_path):
    new = _summary(tmp_path, "new", VLLM)
    config = new["config"]
    assert (config["kv_dtype"], config["memory_utilization"], config["num_blocks"], config["block_manager"]) == ("int8", 0.8, 60, "paged")
    demo = load_run_trace(RunConfig(trace="demo"))
    ratio = 2.0 / ((len(demo) - 1) / float(demo.arrival_s[-1]))
    old = _summary(tmp_path, "old", [repr(ratio) if a == "RATIO" else a for a in OLD])
    for key in ("requests_completed", "duration_s", "ttft_s", "tpot_s", "preemptions", "num_kv_blocks"):
        assert old[key] == pytest.approx(new[key], rel=1e-9), key


def test_help_lists_vllm_names_and_every_default():
    text = CliRunner().invoke(main, ["simulate", "--help"]).output
    for name in ("--gpu-memory-utilization", "--kv-cache-dtype", "--num-gpu-blocks-override", "--enable-prefix-caching",
                 "--enable-chunked-prefill", "--max-num-batched-tokens", "--max-num-seqs", "--max-model-len", "--swap-space",
                 "--preemption-mode", "--request-rate", "[default: prefix]", "[default: fcfs]", "[default: 0.9]"):
        assert name in text
    for hidden in ("--kv-dtype ", "--memory-utilization", "--num-blocks ", "--scale-rate"):
        assert hidden not in text


def test_request_rate_is_realised_on_the_trace():
    trace = load_run_trace(RunConfig(trace="azure_conv_10min", request_rate=12.5))
    assert (len(trace) - 1) / float(trace.arrival_s[-1]) == pytest.approx(12.5)


def test_toml_takes_vllm_keys_and_refuses_both_spellings(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('kv_cache_dtype = "int8"\ngpu_memory_utilization = 0.7\nswap_space = 0\nenable_chunked_prefill = false\n')
    config = load_run_config(path)
    assert (config.kv_dtype, config.memory_utilization, config.swap_space_gb) == ("int8", 0.7, 0)
    assert resolve(config).config.scheduler_params == {"chunked_prefill": False}
    path.write_text('kv_cache_dtype = "int8"\nkv_dtype = "bf16"\n')
    with pytest.raises(ValueError, match="kv_cache_dtype and kv_dtype both given"):
        load_run_config(path)


def test_prefix_caching_switch_maps_onto_block_managers():
    assert RunConfig(enable_prefix_caching=False).normalized().block_manager == "paged"
    assert RunConfig(enable_prefix_caching=True).normalized().block_manager == "prefix"
    assert RunConfig(block_manager="contiguous", enable_prefix_caching=False).normalized().block_manager == "contiguous"
    with pytest.raises(ValueError, match="needs block_manager 'prefix'"):
        RunConfig(block_manager="paged", enable_prefix_caching=True).normalized()
