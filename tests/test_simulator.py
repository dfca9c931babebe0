"""The simulator: the engine's decode batch changes no decision, runs are deterministic, and the
classic results of paged KV management come out of it on real traces."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from kvsim import traces
from kvsim.cli.main import main
from kvsim.policies.engine import EngineCore
from kvsim.policies.plan import PlanDetail
from kvsim.policies.schedulers import FCFSPolicy, PriorityPolicy
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import RunConfig, resolve
from kvsim.sim.run.simulator import SimOptions, simulate


class ReferenceLog:
    """The decision log as plain lines (``to_json`` of every plan), as the reader expands it."""

    plan_detail = PlanDetail.TABLES

    def __init__(self) -> None:
        self.lines: list[str] = []

    def plan(self, plan) -> None:
        self.lines.append(plan.to_json())

    def getvalue(self) -> str:
        return "".join(line + "\n" for line in self.lines)


# The same policies with their running order restated: the engine keeps no decode batch for a
# policy that orders running requests itself, so these decide request by request.
class UnbatchedFCFS(FCFSPolicy):
    def running_order(self, view):
        return view.running


class UnbatchedPriority(PriorityPolicy):
    def running_order(self, view):
        return view.running


def run(trace, check: bool = False, unbatched: bool = False, log: bool = False, **overrides):
    resolved = resolve(RunConfig(**overrides))
    timer = CostModelTimer(resolved.cost_model())
    engine_config = resolved.engine_config
    if unbatched:
        name = {"fcfs": "UnbatchedFCFS", "priority": "UnbatchedPriority"}[engine_config.scheduler]
        engine_config = dataclasses.replace(engine_config, scheduler=f"{__name__}:{name}")
    reference = ReferenceLog()
    result = simulate(trace, EngineCore(engine_config), timer, SimOptions(check=check, decisions=reference if log else None))
    return result, reference.getvalue()


def comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "wall_s"}


@pytest.mark.parametrize(
    "sample, rows, overrides",
    [
        ("azure_conv_10min", 200, dict(block_manager="paged", num_blocks=900, block_size=16)),
        ("mooncake_500", 120, dict(block_manager="prefix", num_blocks=2000, max_model_len=131072, model="qwen2.5-7b")),
        ("azure_conv_10min", 150, dict(block_manager="contiguous", num_blocks=3000, block_size=16, max_model_len=4096)),
        ("azure_conv_10min", 150, dict(block_manager="prefix", num_blocks=300, block_size=16, preemption_mode="swap",
                                       max_num_batched_tokens=512)),
        ("azure_conv_10min", 150, dict(block_manager="paged", scheduler="priority", num_blocks=250, block_size=16,
                                       max_num_batched_tokens=256)),
    ],
)
def test_the_decode_batch_decides_as_request_by_request(sample, rows, overrides):
    """Same plans step for step (whole plans, with tables), same metrics with and without a log."""
    trace = traces.first(traces.load_named(sample), rows)
    batched, batched_log = run(trace, log=True, **overrides)
    reference, reference_log = run(trace, unbatched=True, log=True, **overrides)
    assert batched.engine._batching and not reference.engine._batching
    assert batched_log == reference_log
    assert batched.request_rows() == reference.request_rows()
    assert comparable(batched.summary()) == comparable(reference.summary())
    assert batched.steps.columns == reference.steps.columns
    bare, _ = run(trace, log=False, **overrides)  # plans without tables: the members' entries left out
    assert bare.request_rows() == reference.request_rows() and bare.steps.columns == reference.steps.columns


def test_forks_and_preemption_under_check():
    """Parallel samples (copy-on-write) and a pool too small, with every invariant checked each step."""
    trace = traces.synthesize(
        n_requests=60, rate=40.0, prompt=traces.Uniform(50, 400), output=traces.Uniform(5, 120),
        n_samples=3, seed=3,
    )
    result, _ = run(trace, check=True, model="tiny", device="cpu", block_manager="prefix",
                    block_size=16, num_blocks=120, max_model_len=1024, preemption_mode="swap", swap_space_gb=0.001)
    summary = result.summary()
    assert summary["requests_completed"] == 60
    assert summary["preemptions"] > 0
    assert result.engine.kv_stats().copies > 0


def test_same_seed_same_outputs(tmp_path):
    args = ["simulate", "--trace", "demo", "--model", "llama-2-7b", "--num-blocks", "40", "--block-size", "16", "--quiet",
            "--decisions", "full"]
    runner = CliRunner()
    for name in ("a", "b"):
        result = runner.invoke(main, [*args, "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    for file in ("decisions.delta.gz", "decisions.digest.json", "requests.csv", "steps.csv"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


def test_simulate_cli_writes_the_run(tmp_path):
    result = CliRunner().invoke(main, ["simulate", "--trace", "demo", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "Successful requests:" in result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("requests_completed", "requests_rejected", "duration_s", "throughput_tok_s", "request_rate_rps",
                "preemptions", "prefix_hit_rate", "num_kv_blocks", "peak_kv_blocks_used", "mean_kv_usage", "wall_s",
                "config"):
        assert key in summary, key
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
    assert summary["requests_completed"] == len(traces.load_named("demo"))
    assert summary["config"]["model"] == "llama-2-7b"
    header = (tmp_path / "requests.csv").read_text().splitlines()[0]
    assert header.startswith("request_id,trace_index")
    assert len((tmp_path / "steps.csv").read_text().splitlines()) == summary["steps"] + 1


def test_simulate_cli_bad_input_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["simulate", "--trace", "demo", "--model", "nope", "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert "unknown model 'nope'" in result.output
    assert "Traceback" not in result.output


# --- the classic results ------------------------------------------------------------------


def test_paged_beats_contiguous_at_equal_memory():
    """Worst-case reservations waste most of the pool: paging runs more requests at once."""
    trace = traces.first(traces.load_named("azure_conv_10min"), 600)
    common = dict(num_blocks=2000, block_size=16, max_model_len=4096)
    paged, _ = run(trace, block_manager="paged", **common)
    contiguous, _ = run(trace, block_manager="contiguous", **common)
    batch_paged = paged.steps.array("batch_size").max()
    batch_contiguous = contiguous.steps.array("batch_size").max()
    assert batch_contiguous <= 2000 * 16 // 4096
    assert batch_paged > 2 * batch_contiguous
    assert paged.summary()["throughput_tok_s"] > contiguous.summary()["throughput_tok_s"]
    assert paged.summary()["ttft_s"]["p50"] < contiguous.summary()["ttft_s"]["p50"]


def test_int8_kv_doubles_the_blocks():
    fp16 = resolve(RunConfig(model="llama-2-7b", kv_dtype="fp16"))
    int8 = resolve(RunConfig(model="llama-2-7b", kv_dtype="int8"))
    # C8: a block holds int8 K/V only (half the fp16 bytes); the static per-channel scales are
    # charged once, outside the blocks.
    assert int8.memory.bytes_per_block * 2 == fp16.memory.bytes_per_block
    assert int8.memory.kv_scale_bytes > 0
    expected = (fp16.memory.kv_available_bytes - int8.memory.kv_scale_bytes) // int8.memory.bytes_per_block
    assert int8.engine_config.num_blocks == expected
    assert int8.engine_config.num_blocks / fp16.engine_config.num_blocks == pytest.approx(2, rel=3e-3)


def test_prefix_caching_cuts_prefill_and_ttft_on_mooncake():
    """The first 250 Mooncake requests overload one 910B: the cache still serves 3-4 % of input
    tokens at first admission (the trace's infinite-cache bound this early is about 6 %) and,
    more, lets preempted requests resume from their own cached blocks."""
    trace = traces.first(traces.load_named("mooncake_500"), 250)
    common = dict(model="qwen2.5-7b", max_model_len=131072, num_blocks=6000)
    cached, _ = run(trace, block_manager="prefix", **common)
    plain, _ = run(trace, block_manager="paged", **common)
    assert cached.summary()["prefix_hit_rate"] > 0.02
    assert cached.steps.array("prefill_tokens").sum() < 0.9 * plain.steps.array("prefill_tokens").sum()
    assert cached.summary()["ttft_s"]["p50"] < plain.summary()["ttft_s"]["p50"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pool_too_small_survives_with_preemptions(mode):
    trace = traces.first(traces.load_named("azure_conv_10min"), 300)
    result, _ = run(trace, block_manager="paged", num_blocks=400, block_size=16, max_model_len=4096,
                    preemption_mode=mode, swap_space_gb=1.0)
    summary = result.summary()
    assert summary["preemptions"] > 0
    assert summary["requests_completed"] + summary["requests_rejected"] == 300
    assert result.engine.kv_stats().used == 0
    if mode == "swap":
        assert result.engine.counters.swap_preemptions > 0
        assert result.steps.array("swap_blocks").sum() > 0
