"""``kvsim validate`` of a P/D pair (``--prefill-instances 1 --decode-instances 1``): the real pair of
realexec/pd_pair.py against the simulation of the same layout, checked and judged as one engine is.

The runs are one engine's three (real, replay, free simulation), each a P/D cluster run: the replay
hands both instances their measured step times and the channel's measured transfers, so the two
decision logs of each instance must agree line for line; the free simulation prices steps with the
machine's profile and transfers with a link fitted on the pair's channel once the real run is over
(``profile-for-pair.toml``: the profile with that link as its ``[topology]``). The checks are one
engine's over both instances' steps and the pair's latencies, with one more: each transfer of the
run against the simulation's price of it, the median of measured over simulated (``kv_transfer``):
a comparison of the same transfers, as the per-step check compares the same steps, where the
medians of the two runs' transfers would mix each size with the noise of one transfer (40 in the
default run, whose single timings scatter by a fifth). The link is fitted on the channel timed before
and after the run; that check's real-vs-real spread is how far the two sets lie apart (the median
over the sizes): how far the machine moved a transfer over the run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvsim.cli.validate import judge, one_device, timed_steps
from kvsim.realexec.backends import KernelBackend
from kvsim.realexec.pd_pair import ChannelFit, execute_pair, fit_channel, save_pair_profile
from kvsim.realexec.repeatability import TimedSteps, at_machine_speed
from kvsim.realexec.speed_check import speed_check
from kvsim.realexec.validation import (
    Thresholds,
    check_row,
    compare_decisions,
    step_classes,
    step_errors,
    validate_runs,
)
from kvsim.sim.cluster.disagg import PDRun
from kvsim.sim.cluster.kv_transfer import RecordedMover
from kvsim.sim.cluster.runner import run_cluster
from kvsim.sim.perf.device import load_device
from kvsim.sim.perf.step_timer import ReplayTimer
from kvsim.sim.run.config import RunConfig, resolve
from kvsim.sim.run.decisions import read_decisions

TRANSFER_CHECK = "kv_transfer_rel_error"


def pair_decisions(real_dir: Path, replay_dir: Path, instances: int) -> dict:
    """Each instance's decision log, real against replay: the first instance that diverges, or identical."""
    steps = 0
    for i in range(instances):
        one = compare_decisions(list(read_decisions(real_dir / "instances" / str(i))),
                                list(read_decisions(replay_dir / "instances" / str(i))))
        steps += one["steps_compared"]
        if not one["identical"]:
            return {**one, "steps_compared": steps, "instance": i}
    return {"identical": True, "steps_compared": steps, "first_divergence": None}


def cross_validate_pair(config: RunConfig, trace, backend: KernelBackend, profile_path: Path, out_dir: Path,
                        thresholds: Thresholds, retime_passes: int) -> dict:
    """The pair's three runs, their comparison and its verdict (module docstring); ``cross_validate``'s keys, plus
    ``transfers``; writes nothing beside the runs (``validate`` writes validation.json)."""
    single_cost = resolve(one_device(config).updated(device=str(profile_path))).cost_model()
    before = speed_check(backend, single_cost, seed=config.seed)
    real, real_summary = execute_pair(config, backend, out_dir / "real", trace, decisions="full", retime_passes=retime_passes)
    measured = real_summary["measured"]
    base = load_device(profile_path).topology or load_device("cpu").topology
    channel = fit_channel(measured["transfers"], base)
    pair_profile = save_pair_profile(profile_path, channel.topology, out_dir / "profile-for-pair.toml")
    sim_resolved = resolve(config.updated(device=str(pair_profile), num_blocks=real.runs[0].engine.config.num_blocks))
    cost = sim_resolved.cost_model()

    timed = [timed_steps(run) for run in real.runs]
    replay_timers = [ReplayTimer(steps, predict=cost.step_time) for steps in timed]
    mover = RecordedMover({row: t.wire_s for row, t in real.transfers.items()})
    run_cluster(sim_resolved, trace, out_dir / "replay", decisions="full", timers=replay_timers, mover=mover)
    decisions = pair_decisions(out_dir / "real", out_dir / "replay", len(real.runs))
    speed = speed_check(backend, single_cost, seed=config.seed)  # right after the real run and its passes
    _, sim_summary = run_cluster(sim_resolved, trace, out_dir / "sim", decisions="off")

    comparison = transfer_comparison(real, channel)
    ratio = comparison["in_run"]["median_ratio"]
    transfer = check_row(TRANSFER_CHECK, None if ratio is None else abs(ratio - 1.0), thresholds.kv_transfer, "transfer")
    memory = sim_resolved.memory
    kv_pool = sim_resolved.engine_config.num_blocks * memory.bytes_per_block
    predicted, kinds, sizes = ([x for t in replay_timers for x in getattr(t, name)] for name in ("predicted", "kinds", "batch_sizes"))
    instances = measured["instances"]
    steps, single_runs, walls = ([x for one in lists for x in one] for lists in
                                 (timed, [i["single_run_s"] for i in instances], [i["step_wall_s"] for i in instances]))
    validation = validate_runs(steps, real_summary, sim_summary, decisions, predicted, kinds, sizes, kv_pool,
                               memory.weight_bytes + memory.activation_bytes + kv_pool, thresholds, extra_checks=(transfer,))
    validation["transfers"] = {**comparison, "p50": {"real": real_summary["pd"]["transfer_s"]["p50"],
                                                      "sim": sim_summary["pd"]["transfer_s"]["p50"]}}
    validation["timing"]["per_step"]["single_run"] = step_errors(predicted, single_runs, kinds, sizes)

    engines = [TimedSteps(one, t.predicted, cost.step_time, step_classes(t.kinds, t.batch_sizes))
               for one, t in zip(timed, replay_timers)]
    judge(validation, engines, [i["retimed_s"] for i in instances], real_summary,
          lambda timers: run_cluster(sim_resolved, trace, None, decisions="off", timers=timers, mover=mover)[1],
          lambda s: run_cluster(at_machine_speed(sim_resolved, s), trace, None, decisions="off")[1],
          before, speed, sim_resolved.device, thresholds,
          # the channel timed after the run against before it; the link's time does not scale with the machine's compute
          own={TRANSFER_CHECK: (channel.spread, transfer["value"])}, advice=backend.rerun_advice)
    validation["timing"]["per_step"].update(noise_floor=sim_resolved.device.step_timing_noise,
                                            timing_repeats=measured["timing_repeats"])
    validation["timing"]["wall_clock"] = {"steps_wall_s": sum(walls), "steps_device_clock_s": sum(steps)}
    validation["profile"] = str(pair_profile)
    validation["series"] = {"step_time": {"measured": steps, "predicted": predicted, "kind": kinds, "batch_size": sizes,
                                          "instance": [i for i, one in enumerate(timed) for _ in one],
                                          "single_run": single_runs, "wall": walls}}
    return validation


def transfer_comparison(real: PDRun, channel: ChannelFit) -> dict:
    """The run's transfers against the fitted link's price of each, and the channel's timed sets against it."""
    measured = np.array([t.wire_s for t in real.transfers.values()])
    predicted = np.array([channel.link.seconds(t.nbytes) for t in real.transfers.values()])
    return {"link": {"latency_s": channel.link.latency_s, "bandwidth": channel.link.bandwidth},
            "in_run": {"transfers": int(measured.size),
                       "mape": float(np.mean(np.abs(predicted - measured) / measured)) if measured.size else None,
                       "median_ratio": float(np.median(measured / predicted)) if measured.size else None},
            "channel": channel.rows, "channel_spread": channel.spread}
