"""A TP rank's slowdown beside its peers: two factors (memory-bound work, compute-bound work) fitted on the
group's reference steps (realexec/group_profile.py)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")

from kvsim.realexec.group_profile import group_factors  # noqa: E402
from kvsim.realexec.profile_shapes import decode, prefill, shape_features  # noqa: E402
from kvsim.sim.perf.cost_model import CostModel  # noqa: E402
from kvsim.sim.perf.device import load_device, scaled_profile  # noqa: E402
from kvsim.sim.run.config import RunConfig, resolve  # noqa: E402

SHAPES = (decode(1, 128), decode(8, 256), prefill(256))


def test_a_compute_factor_divides_the_compute_efficiencies_and_nothing_else() -> None:
    cpu = load_device("cpu")
    split = scaled_profile(cpu, 1.3, compute_factor=0.8)
    for name, c in cpu.operators.items():
        s = split.operators[name]
        assert s.call_s == pytest.approx(c.call_s * 1.3)
        if c.compute_efficiency is not None:
            assert s.compute_efficiency == pytest.approx(c.compute_efficiency / 0.8)
        if c.memory_efficiency is not None:
            assert s.memory_efficiency == pytest.approx(c.memory_efficiency / 1.3)
    assert scaled_profile(cpu, 1.3, compute_factor=1.3).operators == scaled_profile(cpu, 1.3).operators
    with pytest.raises(ValueError, match="compute_factor"):
        scaled_profile(cpu, 1.3, compute_factor=0.0)


@pytest.mark.parametrize("memory, compute", [(1.3, 0.85), (1.2, 1.2), (1.05, 1.4)])
def test_the_fit_finds_the_factors_that_made_the_steps(memory: float, compute: float) -> None:
    """Steps timed as a profile slowed by known factors predicts them: the fit gives those factors back,
    where a single factor (the old rule) would have priced the prefill by a decode's slowdown."""
    resolved = resolve(RunConfig(model="small", device="cpu", tensor_parallel_size=2))
    cost = resolved.cost_model()
    device = cost.device
    features = [shape_features(shape, resolved.config.block_size) for shape in SHAPES]
    truth = CostModel(cost.rank_spec, scaled_profile(device, memory, compute_factor=compute), cost.block_size,
                      cost.rank.kv_dtype, routing=cost.routing)
    targets = [float(truth.predict(f)) for f in features]
    fitted_memory, fitted_compute = group_factors(targets, features, cost, device)
    assert fitted_memory == pytest.approx(memory, rel=0.01)
    assert fitted_compute == pytest.approx(compute, rel=0.01)


def test_a_factor_no_step_depends_on_keeps_the_median_start() -> None:
    """On a device where compute never binds, the compute factor is not identified: it stays at the single
    factor the steps' median gives, instead of wandering to a bound."""
    resolved = resolve(RunConfig(model="small", device="cpu", tensor_parallel_size=2))
    cost = resolved.cost_model()
    unbound = dataclasses.replace(cost.device, matrix_flops={k: v * 1e6 for k, v in cost.device.matrix_flops.items()},
                                  vector_flops=cost.device.vector_flops * 1e6)
    features = [shape_features(shape, resolved.config.block_size) for shape in SHAPES]
    base = CostModel(cost.rank_spec, unbound, cost.block_size, cost.rank.kv_dtype, routing=cost.routing)
    targets = [1.25 * float(base.predict(f)) for f in features]
    memory, compute = group_factors(targets, features, cost, unbound)
    assert memory == pytest.approx(1.25, rel=0.01) and compute == pytest.approx(1.25, rel=0.01)
