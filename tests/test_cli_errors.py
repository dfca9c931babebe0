"""The CLI's error boundary: every user mistake exits 2 with one line naming it; a bug exits 1.

Each case is a mistake found ending in a traceback (or silently accepted) before the boundary;
the test asserts exit status 2, a single output line, the culprit named, and no traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvsim.cli.main import main

PLUGIN = "class Boom:\n    def __init__(self, *args, **kwargs):\n        raise RuntimeError('plugin exploded')\n"


def _mooncake(path: Path, timestamps_ms: list[int]) -> str:
    rows = [{"timestamp": t, "input_length": 10, "output_length": 5, "hash_ids": [1]} for t in timestamps_ms]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _read_only_dir(tmp_path: Path) -> str:
    if os.geteuid() == 0:  # root writes through permission bits; /sys refuses mkdir even to root
        return "/sys/kvsim-test-out"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return str(locked / "out")


def _cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (arguments, substrings the one-line error must contain)."""
    (tmp / "a_file").write_text("x")
    (tmp / "a_dir").mkdir()
    (tmp / "seed.toml").write_text('seed = "abc"\n')
    (tmp / "unknown.toml").write_text("block_sizes = 16\n")
    (tmp / "params.toml").write_text("[scheduler_params]\nbogus = 1\n")
    (tmp / "boom_plugin.py").write_text(PLUGIN)
    (tmp / "full").mkdir()
    (tmp / "full" / "summary.json").write_text("{}")
    (tmp / "typo_base.toml").write_text('base = "h100-sxn"\nhbm_bandwidth = 4e12\n')
    sim = ["simulate", "--quiet", "--max-requests", "5"]
    out = ["--out", str(tmp / "run")]
    return {
        "missing trace": ([*sim, "--trace", str(tmp / "nope.jsonl"), *out], ["nope.jsonl", "no such file"]),
        "trace is a directory": ([*sim, "--trace", str(tmp / "a_dir"), *out], ["a_dir", "is a directory"]),
        "unknown scheduler": ([*sim, "--scheduler", "fifo", *out], ["scheduler", "fifo", "fcfs"]),
        "unknown block manager": ([*sim, "--block-manager", "pagd", *out], ["block manager", "pagd", "paged"]),
        "bad module:Class": ([*sim, "--scheduler", "no_such_module:Cls", *out], ["no_such_module:Cls"]),
        "plugin raises": ([*sim, "--scheduler", "boom_plugin:Boom", *out], ["boom_plugin:Boom", "plugin exploded"]),
        "unknown policy parameter": ([*sim, "--config", str(tmp / "params.toml"), *out], ["bogus", "fcfs"]),
        "toml value of the wrong type": ([*sim, "--config", str(tmp / "seed.toml"), *out], ["seed.toml", "seed", "'abc'", "integer"]),
        "unknown toml key": ([*sim, "--config", str(tmp / "unknown.toml"), *out], ["unknown.toml", "block_sizes"]),
        "value out of range": ([*sim, "--gpu-memory-utilization", "1.5", *out], ["gpu_memory_utilization", "1.5", "(0, 1]"]),
        "out under a file": ([*sim, "--out", str(tmp / "a_file" / "run")], ["a_file", "not a directory"]),
        "out read-only": ([*sim, "--out", _read_only_dir(tmp)], ["--out", "kvsim-test-out" if os.geteuid() == 0 else "locked"]),
        "out not empty": ([*sim, "--out", str(tmp / "full")], ["full", "--overwrite"]),
        "tp not dividing the heads": ([*sim, "--model", "llama-3.1-70b", "-tp", "3", *out], ["--tensor-parallel-size 3", "64"]),
        "ep without experts": ([*sim, "--model", "qwen3-32b", "-tp", "2", "--enable-expert-parallel", *out],
                               ["--enable-expert-parallel", "not an MoE model"]),
        "pipeline parallel on the real executor": (["validate", "-pp", "2", *out], ["--pipeline-parallel-size", "simulated only"]),
        "tensor parallel on a backend this machine lacks": (["execute", "-tp", "2", "--backend", "cuda", *out],
                                                            ["cuda backend unavailable"]),
        "dual batch overlap on the real executor": (["execute", "--model", "small-moe", "-tp", "2", "--enable-expert-parallel",
                                                     "--all2all-backend", "deepep_low_latency", "--enable-dbo", *out],
                                                    ["--enable-dbo", "simulated only"]),
        "real tp not dividing the columns": (["execute", "-tp", "3", *out], ["--tensor-parallel-size 3", "2048"]),
        "real ep without tp": (["execute", "--model", "small-moe", "--enable-expert-parallel", *out],
                               ["--enable-expert-parallel", "--tensor-parallel-size 2"]),
        "kv tiers on the real executor": (["execute", "--kv-offload-host-gb", "1", *out], ["--kv-offload-host-gb", "simulated only"]),
        "device file's base unknown": (["memory", "--model", "llama-2-7b", "--device", str(tmp / "typo_base.toml")],
                                       ["typo_base.toml", "base", "'h100-sxn'", "h100-sxm"]),
        "device info: unknown device": (["device", "info", "--device", "h100-sxn"], ["unknown device 'h100-sxn'", "h100-sxm"]),
        "memory model is a directory": (["memory", "--model", str(tmp / "a_dir"), "--device", "ascend-910b3"], ["a_dir"]),
        "block size vs trace hash block size": (
            ["simulate", "--quiet", "--trace", "mooncake_500", "--block-size", "100", *out], ["block_size 100", "hash block size"]),
        "negative timestamp": ([*sim, "--trace", _mooncake(tmp / "neg.jsonl", [1000, -10**15, 2000]), *out],
                               ["neg.jsonl", "requests 1 and 2", "negative or far-future"]),
        "far-future timestamp": ([*sim, "--trace", _mooncake(tmp / "far.jsonl", [0, 1000, 10**15]), *out],
                                 ["far.jsonl", "requests 2 and 3", "over a year"]),
        "rate near zero": ([*sim, "--rate-scale", "1e-300", *out], ["rate scaled by 1e-300", "rate near zero"]),
        "request rate and rate scale": ([*sim, "--request-rate", "2", "--rate-scale", "3", *out], ["request_rate", "rate_scale"]),
        "chunked scheduler without chunking": ([*sim, "--scheduler", "chunked", "--no-enable-chunked-prefill", *out],
                                               ["chunked", "enable_chunked_prefill"]),
        "execute: missing trace": (["execute", "--quiet", "--trace", str(tmp / "nope.jsonl"), *out], ["nope.jsonl", "no such file"]),
        "validate: missing trace": (["validate", "--quiet", "--trace", str(tmp / "nope.jsonl"), *out], ["nope.jsonl", "no such file"]),
        "profile: unknown model": (["profile", "--model", "llama-9", "--out", str(tmp / "p.toml")], ["unknown model 'llama-9'"]),
        "profile: unknown base device": (["profile", "--model", "tiny", "--base-device", "npu-x", "--out", str(tmp / "p.toml")],
                                         ["unknown device 'npu-x'"]),
        "report compare: not a run directory": (["report", "compare", str(tmp / "a_dir"), *out], ["a_dir", "no summary.json"]),
        "decisions: no digest": (["decisions", "digest", str(tmp / "a_dir")], ["a_dir", "no decision digest"]),
    }


def _no_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


@pytest.mark.skipif(not _no_cuda(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", ["validate", "execute"])
def test_the_cuda_backend_without_cuda_is_one_line_exit_2(command, tmp_path):
    pytest.importorskip("torch")
    result = CliRunner().invoke(main, [command, "--backend", "cuda", "--quiet", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [result.output.strip()] and "cuda backend unavailable" in result.output
    assert not (tmp_path / "run").exists()


def _case_names() -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return list(_cases(Path(tmp)))


@pytest.mark.parametrize("name", _case_names())
def test_user_mistake_is_one_line_exit_2(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args, expected = _cases(tmp_path)[name]
    result = CliRunner().invoke(main, args)
    output = result.output.strip()
    assert result.exit_code == 2, f"{name}: exit {result.exit_code}\n{output}"
    assert "Traceback" not in output
    assert len(output.splitlines()) == 1, output
    for part in expected:
        assert part in output, f"{name}: {part!r} not in {output!r}"
    assert not (tmp_path / "run").exists()


def test_a_bug_exits_1_with_a_hint_and_debug_shows_the_traceback(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero somewhere deep")

    monkeypatch.setattr("kvsim.cli.simulate.run_trace", broken)
    monkeypatch.setenv("KVSIM_DEBUG", "0")  # restored after the test, though --debug sets it
    args = ["simulate", "--quiet", "--max-requests", "3", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "internal error: ZeroDivisionError" in result.output and "--debug" in result.output
    assert "Traceback" not in result.output
    debug = CliRunner().invoke(main, ["--debug", *args])
    assert isinstance(debug.exception, ZeroDivisionError)  # propagated: click's runner would print the traceback
