"""Every served fidelity row is a ``kvsim simulate`` command that prints the row's predicted figure, exactly."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvsim.cli.main import main
from kvsim.sim.perf.device import load_device
from kvsim.sim.studies.fidelity import load_published, predict_row, row_command, row_trace
from kvsim.traces.canonical import save as save_trace

ROWS = {row.id: row for row in load_published().rows}
# One row of each client kind: offline batch (V0), burst through the API server (V0; V1 streaming tokens),
# a parallel W8A8 MoE layout, Poisson arrivals, closed-loop clients (the last two cut to a few prompts: same path, less time).
CASES = [
    ROWS["va776-latency-bs8"],
    ROWS["va776-qpsinf-ttft"],
    ROWS["gs910b-random128-total"],
    ROWS["gsq235-fp8-tp4ep-sharegpt-total"],
    dataclasses.replace(ROWS["va776-qps1-ttft"], num_prompts=30, input_total=30 * 200, output_total=30 * 100),
    dataclasses.replace(ROWS["gsh100-bs1-tpot"], num_prompts=12, input_total=12 * 200, output_total=12 * 100, concurrency=3),
]


@pytest.mark.parametrize("row", CASES, ids=[row.id for row in CASES])
def test_a_rows_simulate_command_prints_its_predicted_figure(row, tmp_path: Path) -> None:
    trace = save_trace(row_trace(row, "lognormal"), tmp_path / "row.jsonl")
    command = row_command(row, str(trace))
    assert command[:2] == ["kvsim", "simulate"]
    result = CliRunner().invoke(main, [*command[1:], "--out", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    bench = json.loads((tmp_path / "run" / "summary.json").read_text())["bench"]
    assert bench[row.metric] == predict_row(row, load_device(row.device), "lognormal")


def test_memory_rows_have_no_simulate_command() -> None:
    assert row_command(ROWS["vllm21348-tp4"], "unused.jsonl") is None


def test_the_benchmark_client_is_simulated_only(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["execute", "--backend", "cpu", "--model", "tiny", "--max-concurrency", "4",
                                      "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "--max-concurrency: the real executor replays the trace's arrivals" in result.output


def test_a_sweep_point_with_clients_gets_the_bench_figures_and_capacity_refuses_them(tmp_path: Path) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text('model = "qwen2.5-7b"\ndevice = "ascend-910b3"\ntrace = "demo"\nmax_requests = 12\n'
                    "[grid]\napi_server = [false, true]\n")
    result = CliRunner().invoke(main, ["sweep", str(grid), "--out", str(tmp_path / "sweep"), "--jobs", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((tmp_path / "sweep" / "sweep.csv").open()))
    assert [r["bench_ttft_median"] == "" for r in rows] == [True, False]
    # the API server's admission and hand-over delay every first token
    assert float(rows[1]["bench_ttft_median"]) > float(rows[0]["ttft_s_p50"])
    result = CliRunner().invoke(main, ["capacity", str(grid), "--out", str(tmp_path / "cap"), "--quiet"])
    assert result.exit_code == 2
    assert "api_server / max_concurrency: capacity searches open-loop arrival rates" in result.output


def test_v1_rows_replay_with_prefix_caching_and_v0_rows_without() -> None:
    assert ROWS["gsq14-random32k-total"].block_manager == "prefix"  # vLLM V1's default
    assert ROWS["va776-qps1-ttft"].block_manager == "paged"  # V0's
    assert dataclasses.replace(ROWS["gsq14-random32k-total"], enable_prefix_caching=False).block_manager == "paged"


def test_prefix_caching_keeps_a_preempted_requests_blocks(tmp_path: Path) -> None:
    """Qwen3-14B's 32K burst on one H100: the pool holds 8 of the 100 prompts, so requests admitted
    chunk by chunk get preempted; with V1's prefix caching a re-admitted request finds the blocks it
    had computed, without it every preemption computes them again and preempts the next in turn."""
    row = dataclasses.replace(ROWS["gsq14-random32k-total"], num_prompts=30)
    trace = save_trace(row_trace(row, "lognormal"), tmp_path / "row.jsonl")
    preemptions = {}
    for manager in ("prefix", "paged"):
        command = [manager if word == row.block_manager else word for word in row_command(row, str(trace))]
        result = CliRunner().invoke(main, [*command[1:], "--out", str(tmp_path / manager), "--quiet"])
        assert result.exit_code == 0, result.output
        preemptions[manager] = json.loads((tmp_path / manager / "summary.json").read_text())["preemptions"]
    assert preemptions["paged"] > 5 * max(preemptions["prefix"], 1)
