"""A tensor-parallel group's profile: one rank's, plus what the group adds, measured on the group.

``kvsim validate --tensor-parallel-size N`` profiles one rank's model on one device
(``calibration.rank_model_file``); once the real run is over this module adds the group's links and
the slowdown a rank's compute takes beside its peers (``profile_for_group``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvsim.realexec.backends import KernelBackend
from kvsim.realexec.collective_bench import fitted_and_checked
from kvsim.realexec.executor import Executor
from kvsim.realexec.speed_check import REFERENCE_LABELS, interleaved_reference_times, reference_blocks
from kvsim.realexec.tp_executor import TensorParallelExecutor
from kvsim.sim.perf.cost_model import CostModel
from kvsim.sim.perf.device import load_device, save_device, scaled_profile
from kvsim.sim.run.config import RunConfig, resolve

# Rounds of the group's reference steps and the rank's alone: a ratio of two medians is twice as noisy as one
# (the speed check's 5 rounds moved the factor 0.91-1.34 between runs on the 2-core VM).
GROUP_REFERENCE_ROUNDS = 15


def profile_for_group(profile_path: Path, collectives: dict, config: RunConfig, backend: KernelBackend,
                      one_device: CostModel, out_dir: Path) -> tuple[Path, dict]:
    """One rank's profile (its model on one device, ``one_device``) made the tensor-parallel group's
    (``profile-for-group.toml``), from two measurements taken once the real run is over, neither of
    the run's steps:

    - its ``[topology]`` fitted on the group's collectives (realexec/collective_bench.py), and checked
      on a second set measured after the first;
    - its operators slowed by the factor a rank's compute takes beside its peers': the speed check's
      reference steps on a TP group, less the fitted collectives, over the profile's prediction, against
      the same steps of the rank's model alone on one device (same clock, rounds interleaved with the
      group's) over theirs. The profile's own miss on a step is the machine's state, which the verdict
      weighs; the ratio of the two is the group's. The median of the three. On the 2-core development
      VM a rank's decode step took 5.5 ms beside its peer and 5.0 ms alone (the cores share one memory
      system; an NPU's devices do not), and the first TP runs' decodes measured 1.10x their prediction.
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
            [executor, Executor(one_device.model, backend, **sizing)], config.seed, GROUP_REFERENCE_ROUNDS)  # one rank's model, alone
    finally:
        executor.close()
    comm = [cost.collective_seconds(s.features)[0] for s in samples]
    compute = [float(cost.rank.predict(s.features)) for s in samples]
    alone = [m / float(one_device.predict(s.features)) for m, s in zip(single, single_samples)]
    factors = [(m - c) / p / a for m, c, p, a in zip(measured, comm, compute, alone)]
    factor = sorted(factors)[len(factors) // 2]
    path = save_device(scaled_profile(linked, factor, why="a TP rank's compute beside its peers' (the group's reference steps)"),
                       out_dir / "profile-for-group.toml")
    errors = {kind: sorted(abs(row["error"]) for row in checked if row["kind"] == kind) for kind in ("all_reduce", "all_gather")}
    return path, {"ranks": ranks, "latency_s": topology.intra_latency_s, "bandwidth": topology.intra_bandwidth,
                  "checked": checked, **{f"{kind}_median_abs_error": e[len(e) // 2] for kind, e in errors.items()},
                  **{f"{kind}_max_abs_error": e[-1] for kind, e in errors.items()},
                  "compute_factor": factor, "reference_steps": {
                      label: {"measured_s": m, "collectives_s": c, "compute_predicted_s": p, "one_device_ratio": a}
                      for label, m, c, p, a in zip(REFERENCE_LABELS, measured, comm, compute, alone)}}
