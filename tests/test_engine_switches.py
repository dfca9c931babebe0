"""vLLM's engine switches in a run's configuration: --enforce-eager, --async-scheduling, --engine-core."""

from __future__ import annotations

import dataclasses

import pytest

from kvsim.sim.perf.cost_model import StepFeatures
from kvsim.sim.perf.device import engine_as_run, load_device
from kvsim.sim.run.config import RunConfig, resolve

A2 = load_device("ascend-910b3")


def test_switches_change_the_device_as_the_engine_runs_it() -> None:
    assert engine_as_run(A2) is A2  # nothing asked: the device's own engine
    assert engine_as_run(A2, enforce_eager=True).engine.mode == "eager"
    assert engine_as_run(A2, async_scheduling=True).engine.async_scheduling
    v0 = engine_as_run(A2, engine_core="v0")
    assert v0.operators["host_seq"].call_s == pytest.approx(A2.operators["host_seq"].call_s + A2.engine.v0_seq_s)


def test_switches_that_cannot_apply_are_refused() -> None:
    no_captures = dataclasses.replace(A2, engine=dataclasses.replace(A2.engine, mode="eager", capture_sizes=()))
    with pytest.raises(ValueError, match="capture_sizes"):
        engine_as_run(no_captures, enforce_eager=False)
    with pytest.raises(ValueError, match="no \\[engine\\] table"):
        engine_as_run(load_device("cpu"), async_scheduling=True)
    assert engine_as_run(load_device("cpu"), enforce_eager=True) == load_device("cpu")  # always eager there
    with pytest.raises(ValueError, match="engine_core"):
        resolve(RunConfig(engine_core="v2"))


def test_eager_dispatch_slows_the_steps_a_graph_replays() -> None:
    graph = resolve(RunConfig(model="qwen2.5-7b")).cost_model()
    eager = resolve(RunConfig(model="qwen2.5-7b", enforce_eager=True)).cost_model()
    names = [f.name for f in dataclasses.fields(StepFeatures)]
    step = StepFeatures(**{**dict.fromkeys(names, 0.0), "num_tokens": 8.0, "num_seqs": 8.0, "num_sampled": 8.0,
                           "decode_seqs": 8.0, "decode_ctx_tokens": 8192.0, "blocks_touched": 64.0})
    assert eager.step_total(step) > 1.5 * graph.step_total(step)


def test_a_scaled_profile_predicts_every_step_factor_times_slower() -> None:
    """``kvsim validate --perturb-profile F``: the check of the checker must be what it says."""
    from kvsim.sim.perf.cost_model import CostModel
    from kvsim.sim.perf.device import scaled_profile
    from kvsim.sim.perf.model_spec import load_model

    cpu = dataclasses.replace(load_device("cpu"), gemv_rows=3, row_count_s={2: 2e-3})
    names = [f.name for f in dataclasses.fields(StepFeatures)]
    for device in (cpu, A2):
        model = load_model("small" if device is cpu else "qwen2.5-7b")
        base, slow = CostModel(model, device, 16), CostModel(model, scaled_profile(device, 1.2), 16)
        for tokens in (1.0, 2.0, 8.0, 300.0):
            step = StepFeatures(**{**dict.fromkeys(names, 0.0), "num_tokens": tokens, "num_seqs": tokens, "num_sampled": tokens,
                                   "decode_seqs": tokens, "decode_ctx_tokens": 100 * tokens, "blocks_touched": 7 * tokens})
            assert slow.step_total(step) == pytest.approx(1.2 * base.step_total(step), rel=1e-9)
    plain = CostModel(load_model("small"), scaled_profile(cpu, row_count_terms=False), 16)
    assert plain.device.row_count_s == {} and plain.device.operators == cpu.operators
