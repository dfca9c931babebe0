"""A tensor-parallel group's profile: one rank's, plus what the group adds, measured on the group.

``kvsim validate --tensor-parallel-size N`` profiles one rank's model on one device
(``calibration.rank_model_file``); once the real run is over this module adds the group's links and
the slowdown a rank's work takes beside its peers (``profile_for_group``): one factor for its
compute-bound operators, one for the rest (memory-bound operators and fixed costs).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from kvsim.realexec.backends import KernelBackend
from kvsim.realexec.collective_bench import fitted_and_checked
from kvsim.realexec.executor import Executor
from kvsim.realexec.speed_check import REFERENCE_LABELS, interleaved_reference_times, reference_blocks
from kvsim.realexec.tp_executor import TensorParallelExecutor
from kvsim.sim.parallel.rank_cost import ParallelCostModel
from kvsim.sim.perf.cost_model import CostModel, StepFeatures
from kvsim.sim.perf.device import DeviceProfile, load_device, save_device, scaled_profile
from kvsim.sim.run.config import RunConfig, resolve

# Rounds of the group's reference steps and the rank's alone: a ratio of two medians is twice as noisy as one
# (the speed check's 5 rounds moved the factor 0.91-1.34 between runs on the 2-core VM).
GROUP_REFERENCE_ROUNDS = 15
# Forward passes each run of a group's reference step takes the median of, as the run's steps are timed (the
# executor's timing repeats): a TP step's first pass also waits for the workers to receive the plan and build
# its inputs, which later passes do not (the group and its rank alone are timed alike).
GROUP_STEP_PASSES = 3
# Bounds of either slowdown factor, and the Gauss-Newton iterations that fit them (two unknowns, three steps).
FACTOR_BOUNDS = (0.25, 4.0)
FIT_ITERATIONS = 20


def profile_for_group(profile_path: Path, collectives: dict, config: RunConfig, backend: KernelBackend,
                      one_device: CostModel, out_dir: Path) -> tuple[Path, dict]:
    """One rank's profile (its model on one device, ``one_device``) made the tensor-parallel group's
    (``profile-for-group.toml``), from two measurements taken once the real run is over, neither of
    the run's steps:

    - its ``[topology]`` fitted on the group's collectives (realexec/collective_bench.py), and checked
      on a second set timed in the same rounds as the first;
    - its operators slowed as a rank's work slows beside its peers': the speed check's reference steps
      on a TP group, less the fitted collectives, each over the same step of the rank's model alone on
      one device (same clock, rounds interleaved with the group's) against the profile's prediction of
      it (the profile's own miss on a step is the machine's state, which the verdict weighs; what is
      left is the group's). On the 2-core development VM a rank's decode step took 5.5 ms beside its
      peer and 5.0 ms alone (the cores share one memory system; an NPU's devices do not). That
      slowdown is not one number: in three dense TP2 runs the decodes took 1.10-1.37x beside the
      peer and the 256-token prefill 1.00-1.14x, and one factor (the median of the three steps, a
      decode's) priced every prefill at a decode's slowdown. So two are fitted (``group_factors``):
      compute efficiencies divide by one, memory efficiencies and fixed costs scale by the other.
    """
    ranks = config.tensor_parallel_size
    device = load_device(profile_path)
    topology, checked = fitted_and_checked(collectives, ranks, device.topology or load_device("cpu").topology)
    linked = replace(device, topology=topology)
    group = resolve(config.updated(device=str(save_device(linked, out_dir / "profile-for-group.toml"))))
    cost = group.cost_model()
    sizing = dict(num_blocks=reference_blocks(group.config.block_size), block_size=group.config.block_size, seed=config.seed,
                  kv_dtype=group.memory.kv_dtype)
    executor = TensorParallelExecutor(group.model, backend, ranks, expert_parallel=config.enable_expert_parallel, **sizing)
    try:
        (measured, samples), (single, single_samples) = interleaved_reference_times(
            [executor, Executor(one_device.model, backend, **sizing)],  # the group, and one rank's model alone
            config.seed, GROUP_REFERENCE_ROUNDS, GROUP_STEP_PASSES)
    finally:
        executor.close()
    comm = [cost.collective_seconds(s.features)[0] for s in samples]
    alone = [m / float(one_device.predict(s.features)) for m, s in zip(single, single_samples)]
    targets = [(m - c) / a for m, c, a in zip(measured, comm, alone)]  # the rank's compute, the machine's own miss taken out
    features = [s.features for s in samples]
    memory_factor, compute_factor = group_factors(targets, features, cost, linked)
    path = save_device(scaled_profile(linked, memory_factor, compute_factor=compute_factor,
                                      why="a TP rank's work beside its peers' (the group's reference steps)"),
                       out_dir / "profile-for-group.toml")
    compute = [float(cost.rank.predict(f)) for f in features]
    errors = {kind: sorted(abs(row["error"]) for row in checked if row["kind"] == kind) for kind in ("all_reduce", "all_gather")}
    return path, {"ranks": ranks, "latency_s": topology.intra_latency_s, "bandwidth": topology.intra_bandwidth,
                  "checked": checked, **{f"{kind}_median_abs_error": e[len(e) // 2] for kind, e in errors.items()},
                  **{f"{kind}_max_abs_error": e[-1] for kind, e in errors.items()},
                  "memory_factor": memory_factor, "compute_factor": compute_factor, "reference_steps": {
                      label: {"measured_s": m, "collectives_s": c, "compute_predicted_s": p, "one_device_ratio": a,
                              "factor": t / p}
                      for label, m, c, p, a, t in zip(REFERENCE_LABELS, measured, comm, compute, alone, targets)}}


def group_factors(targets: list[float], features: list[StepFeatures], cost: ParallelCostModel,
                  device: DeviceProfile) -> tuple[float, float]:
    """(memory, compute) factors whose ``scaled_profile`` of ``device`` predicts each step's rank compute
    (``targets``, seconds) best: least squares on the log of measured over predicted, by Gauss-Newton
    from the single factor that fits the steps' median, within ``FACTOR_BOUNDS``. A factor no step's time
    depends on (a device where compute never binds) keeps that starting value."""
    def log_predicted(x: np.ndarray) -> np.ndarray:
        scaled = scaled_profile(device, float(np.exp(x[0])), compute_factor=float(np.exp(x[1])), why="a candidate")
        model = CostModel(cost.rank_spec, scaled, cost.block_size, cost.rank.kv_dtype, routing=cost.routing)
        return np.log([float(model.predict(f)) for f in features])

    goal = np.log(targets)
    x = np.full(2, float(np.median(goal - log_predicted(np.zeros(2)))))
    low, high = np.log(FACTOR_BOUNDS)
    step = 1e-3
    for _ in range(FIT_ITERATIONS):
        at = log_predicted(x)
        jacobian = np.column_stack([(log_predicted(x + step * unit) - at) / step for unit in np.eye(2)])
        move = np.linalg.lstsq(jacobian, goal - at, rcond=None)[0]
        x = np.clip(x + move, low, high)
        if np.max(np.abs(move)) < 1e-5:
            break
    return float(np.exp(x[0])), float(np.exp(x[1]))
