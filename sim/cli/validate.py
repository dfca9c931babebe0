"""``kvsim validate``: run one trace on the device and in the simulator, and compare.

With no arguments: the bundled demo trace, the small model, the CPU backend, a cost model
calibrated for this machine (profiled on the spot and cached when none fits), and a report.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvsim.cli.errors import user_errors
from kvsim.cli.execute import REAL_DEFAULTS, WORKLOAD, execute_run, for_backend, open_backend, require_executor_setup
from kvsim.cli.options import run_config_from, run_options
from kvsim.realexec.backends import BACKEND_NAMES, KernelBackend
from kvsim.realexec.calibration import calibrated_profile, rank_model_file, record_load, recorded_load
from kvsim.realexec.group_profile import profile_for_group
from kvsim.realexec.host_load import ForeignLoad, describe, load_moved
from kvsim.realexec.repeatability import (
    AtSpeed,
    Replay,
    TimedSteps,
    errors_at_speeds,
    machine_speed,
    one_engine,
    real_vs_real,
)
from kvsim.realexec.speed_check import SpeedCheck, speed_check
from kvsim.realexec.validation import (
    Thresholds,
    compare_decisions,
    noisy_profile,
    reference_ratios,
    step_classes,
    step_errors,
    validate_runs,
    verdict,
)
from kvsim.sim.parallel.layout import ParallelLayout
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.perf.device import DeviceProfile, load_device, save_device, scaled_profile
from kvsim.sim.perf.step_timer import ReplayTimer
from kvsim.sim.run.config import RunConfig, load_run_trace, resolve
from kvsim.sim.run.decisions import DecisionLog, read_decisions
from kvsim.sim.run.runner import run_trace
from kvsim.sim.run.simulator import SimOptions, SimRun, simulate

WALL_CLOCK = "wall clock (time.perf_counter), recorded beside the device clock, not compared"
FRESH_PROFILES = 2  # profiles one validate run may measure (a noisy machine's second try is its last)
RETIME_PASSES = 2  # the run's steps timed again, pass after pass, for the real-vs-real spread (docs/validate-verdict.md)


@click.command(help=f"""Cross-validate the simulator against the real executor on the same trace.

Default workload: {WORKLOAD}

Exit status: 0 pass (every check within its limit, the machine at its profiled speed throughout); 1 fail
(a miss larger than the machine's measured repeatability explains); 3 inconclusive (the
machine's speed moved, or its measurements scattered, too much to tell; the line says by how
much and what to do); 2 a mistake in the input. --perturb-profile and --no-row-count-terms
predict with a model known to be wrong: checks of the checker.""")
@run_options(defaults=REAL_DEFAULTS)
@click.option("--backend", type=click.Choice(BACKEND_NAMES), default="cpu", show_default=True)
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Calibrated device profile (from kvsim profile); default: this machine's cached one, else profile now.")
@click.option("--reprofile", is_flag=True, help="Profile this machine again even if a cached profile fits.")
@click.option("--perturb-profile", "perturb", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="A check of the checker: every predicted operator time times this factor (1.2: a model 20 % slow).")
@click.option("--no-row-count-terms", is_flag=True,
              help="A check of the checker: predict without the profile's row-count terms.")
@click.option("--retime-passes", type=click.IntRange(min=1), default=RETIME_PASSES, show_default=True,
              help="Times the run's steps are timed again once it is over, pass after pass: the real-vs-real spread.")
@click.option("--out", "out_dir", default=Path("runs/validate"), show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Where the runs, validation.json and report.html go.")
@click.option("--quiet", is_flag=True)
def validate(backend: str, profile_path: Path | None, reprofile: bool, perturb: float, no_row_count_terms: bool,
             retime_passes: int, out_dir: Path, quiet: bool, **options) -> None:
    config_path = options.get("config_path")
    echo = None if quiet else click.echo
    with user_errors():  # what the user chose: thresholds, config, trace, backend (exit 2)
        thresholds = Thresholds.from_toml(config_path)
        config = run_config_from(options, base=REAL_DEFAULTS)
        require_executor_setup(config)
        trace = load_run_trace(config)
        kernels = open_backend(backend, bool(config.enforce_eager), config.tensor_parallel_size, config.disaggregated)
    try:
        check = None  # the speed check that let this machine's profile stand: the run's reading before it
        if profile_path is None:
            profile_path, check = machine_profile(reference_backend(kernels), one_device(config), reprofile, echo,
                                                  thresholds.step_mape)
        profile_load = recorded_load(profile_path)  # the machine's, before a check of the checker biases a copy
        if perturb != 1.0 or no_row_count_terms:  # predict with a profile known to be wrong
            out_dir.mkdir(parents=True, exist_ok=True)
            measured = load_device(profile_path)
            if no_row_count_terms and echo:
                echo(removed_terms_line(measured))
            biased = scaled_profile(measured, perturb, row_count_terms=not no_row_count_terms)
            profile_path = save_device(biased, out_dir / "biased-profile.toml")
        if config.disaggregated:
            from kvsim.cli.validate_pair import cross_validate_pair

            validation = recorded(cross_validate_pair(config, trace, kernels, profile_path, out_dir, thresholds, retime_passes),
                                  config, kernels, out_dir)
        else:
            validation = cross_validate(config, trace, kernels, profile_path, out_dir, thresholds, progress=not quiet,
                                        retime_passes=retime_passes, before=check, profile_load=profile_load)
    except (ValueError, KeyError, RuntimeError) as exc:  # profiling or a run failed on the device (exit 1)
        raise click.ClickException(str(exc).strip("'\"")) from None

    from kvsim.reports.validation import write_validation_report

    report = write_validation_report(validation, {k: out_dir / k for k in ("real", "sim", "replay")}, out_dir / "report.html")
    if not quiet:
        click.echo(format_checks(validation))
    click.echo(f"report: {report}")
    click.echo(validation["verdict"]["line"], err=validation["verdict"]["exit_code"] != 0)
    raise SystemExit(validation["verdict"]["exit_code"])


def removed_terms_line(device: DeviceProfile) -> str:
    """What ``--no-row-count-terms`` takes out, beside the profile's fastest reference step.

    Where the terms are a few per cent of a step (an H200's: hundredths of a millisecond on
    steps of 0.3-0.5 ms), the model without them is still a right one, and its pass says
    nothing of whether the verdict can fail (docs/validate-verdict.md).
    """
    if not device.row_count_s:
        return ("--no-row-count-terms: the profile has no row-count terms; the model is unchanged, "
                "so this run cannot show the verdict failing")
    terms = ", ".join(f"{rows} tokens {seconds * 1e3:+.2f} ms" for rows, seconds in sorted(device.row_count_s.items()))
    line = f"--no-row-count-terms: the profile's row-count terms left out ({terms})"
    if not device.reference_steps_s:
        return line
    label, fastest = min(device.reference_steps_s.items(), key=lambda item: item[1])
    largest = max(abs(seconds) for seconds in device.row_count_s.values())
    return f"{line}: the largest is {largest / fastest:.0%} of the fastest reference step ({label}, {fastest * 1e3:.2f} ms)"


def machine_profile(kernels: KernelBackend, config: RunConfig, reprofile: bool, echo,
                    step_limit: float = 0.10) -> tuple[Path, SpeedCheck | None]:
    """This machine's calibrated profile and the speed check that let it stand (None: none did). The
    profile is measured anew when the machine no longer runs at its speed, and measured once more
    when a profile measured just now missed its own held-out steps by more than ``step_limit``
    (the validation's per-step threshold): a machine noisy while it was profiled bends the fit. At
    most :data:`FRESH_PROFILES` are measured in one run; of those, the one with the smaller
    held-out error is kept. A cached profile was judged so when it was made,
    and is not measured again for it.

    The stale-profile decision is the speed check's (on the backend's clock): reference steps
    timed now against their times when the profile was measured (the median of the three), off
    by more than its timing noise (at least 10 %), mean the machine's state has moved since it
    was profiled: days ago for a cached profile, or during the minutes of profiling on a shared
    host. Against their times, not the profile's prediction of them: the verdict cannot pass a
    machine that moved that far (realexec/validation.py), and a prediction's own miss on the
    reference steps (8-20 % in this session's CPU profiles) re-measured profiles whose machine
    had not moved (docs/validate-verdict.md). A profile that recorded no reference steps falls
    back on the prediction. Before the reference steps decide, the CPUs other processes keep busy do:
    a profile measured beside other work is measured again on a machine that no longer has it, and the
    other way round (realexec/host_load.py), however its reference steps read: in round 3's twenty-first
    session a profile cached beside a busy ``kvsim fidelity`` read 0.97x on them in a quiet run, whose
    1-sequence decodes then took 0.72x its prediction.

    That check is the run's reading of the machine before it (``cross_validate``): the reading that
    decides whether the profile stands is the one the verdict weighs. On an H200 a second check
    taken seconds after the first read 1.14-1.16x where the first had let the cached profile stand;
    the run was then judged against a profile the machine no longer matched (docs/benchmarks.md).
    """
    kv_dtype = resolve(config).memory.kv_dtype  # the profile must time the KV cache the run will use
    calibrated = calibrated_profile(kernels, config.model, kv_dtype=kv_dtype, refresh="--reprofile" if reprofile else None, echo=echo)
    path, current = calibrated.path, load_device(calibrated.path)
    fresh = [] if calibrated.cached else [(current, calibrated)]
    reason = None if calibrated.cached else missed_held_out(current, step_limit)
    check, checked = None, len(fresh)
    if reason is None:
        with ForeignLoad() as load:
            check = speed_check(kernels, resolve(config.updated(device=str(path))).cost_model(), seed=config.seed)
        if load_moved(calibrated.foreign_cpus, load.cpus):
            which = "the cached profile" if calibrated.cached else "the profile"
            reason = (f"{which} was measured while other processes kept {describe(calibrated.foreign_cpus)} busy, "
                      f"and they keep {describe(load.cpus)} busy now")
        elif stale(check.machine_ratio, current.step_timing_noise):
            which = "the cached profile is stale" if calibrated.cached else "the machine's speed changed while it was profiled"
            baseline = "their time when profiled" if check.profiled_s else "its prediction"
            reason = f"{which}: reference steps took {check.machine_ratio:.2f}x {baseline} on {kernels.clock}"
    while reason is not None and len(fresh) < FRESH_PROFILES:
        again = calibrated_profile(kernels, config.model, kv_dtype=kv_dtype, refresh=reason, echo=echo)
        fresh.append((load_device(again.path), again))
        reason = missed_held_out(fresh[-1][0], step_limit)
    if len(fresh) > checked:  # measured after the check: the check read another profile
        check = None
    if len(fresh) < 2 or any(device.held_out_step_mape is None for device, _ in fresh):
        return path, check
    best, made = min(reversed(fresh), key=lambda pair: pair[0].held_out_step_mape)  # a tie keeps the newer
    if made is not fresh[-1][1]:  # an earlier fit predicted its held-out steps better: keep it, and the load it was measured beside
        save_device(best, path)
        record_load(path, made.foreign_cpus)
        if echo:
            echo(f"kept the first profile: its held-out error {best.held_out_step_mape:.1%} is below the second's "
                 f"{fresh[-1][0].held_out_step_mape:.1%}")
    return path, check


def missed_held_out(device: DeviceProfile, step_limit: float) -> str | None:
    """Why a profile measured just now is measured once more (None: it is not): its fit missed its held-out steps."""
    reason = noisy_profile(device.held_out_step_mape, step_limit)
    return None if reason is None else f"{reason} (the machine was noisy while it was profiled)"


def stale(ratio: float, noise: float | None) -> bool:
    """Did the reference steps (measured / predicted = ``ratio``) stray from the profile by more than its timing noise (at least 10 %)?"""
    return abs(ratio - 1.0) > max(noise or 0.0, 0.1)


def cross_validate(config: RunConfig, trace, backend: KernelBackend, profile_path: Path, out_dir: Path,
                   thresholds: Thresholds, progress: bool = False, retime_passes: int = RETIME_PASSES,
                   before: SpeedCheck | None = None, profile_load: float | None = None) -> dict:
    """The three runs (real, replay, free simulation), their comparison and its verdict; writes validation.json.

    Around the real run: the reference steps before and after it (the machine's speed against
    its profile's), and its steps timed again ``retime_passes`` times once it is over (the
    real-vs-real spread of every figure): what the verdict weighs a miss against. ``before``: the
    check that let the profile stand (``machine_profile``), read against ``profile_path``; None: timed here.
    ``profile_load``: the CPUs other processes kept busy while the profile was measured (recorded in the
    cache beside it; None: not known), reported beside those they keep busy during the real run.
    """
    config = for_backend(config, backend)
    reference = reference_backend(backend)
    single_cost = resolve(one_device(config).updated(device=str(profile_path))).cost_model()
    before = speed_check(reference, single_cost, seed=config.seed) if before is None else before.against(single_cost)
    with ForeignLoad() as run_load:
        real, real_summary = execute_run(config, backend, out_dir / "real", trace=trace, progress=progress, decisions="full",
                                         retime_passes=retime_passes)
    collectives = None
    if config.tensor_parallel_size > 1:  # the group's links and its ranks' compute beside one another, measured after the run
        profile_path, collectives = profile_for_group(profile_path, real_summary["measured"]["collectives"], config,
                                                      backend, single_cost, out_dir)

    sim_resolved = resolve(config.updated(device=str(profile_path), num_blocks=real.engine.config.num_blocks))
    cost = sim_resolved.cost_model()

    timed = timed_steps(real)
    replay_timer = ReplayTimer(timed, predict=cost.step_time)
    (out_dir / "replay").mkdir(parents=True, exist_ok=True)
    replay_log = DecisionLog("full", sim_resolved.engine_config.block_size, out_dir / "replay")
    try:
        simulate(trace, sim_resolved.new_engine(), replay_timer, SimOptions(decisions=replay_log))
    finally:
        replay_log.close()
    decisions = compare_decisions(list(read_decisions(out_dir / "real")), list(read_decisions(out_dir / "replay")))

    speed = speed_check(reference, single_cost, seed=config.seed)  # right after the real run and its passes: the machine as it ran
    _, sim_summary = run_trace(sim_resolved, trace, CostModelTimer(cost), out_dir / "sim", progress=progress)

    memory = resolve(config).memory  # what the memory model says the real run's device holds
    kv_pool = real.engine.config.num_blocks * memory.bytes_per_block
    validation = validate_runs(timed, real_summary, sim_summary, decisions, replay_timer.predicted, replay_timer.kinds,
                               replay_timer.batch_sizes, kv_pool, memory.weight_bytes + memory.activation_bytes + kv_pool, thresholds)
    validation["timing"]["per_step"]["noise_floor"] = sim_resolved.device.step_timing_noise
    measured = real_summary["measured"]
    validation["timing"]["per_step"]["timing_repeats"] = measured["timing_repeats"]
    validation["timing"]["per_step"]["single_run"] = step_errors(replay_timer.predicted, measured["single_run_s"], replay_timer.kinds,
                                                                  replay_timer.batch_sizes)
    if collectives is not None:
        validation["timing"]["collectives"] = collectives
    validation["host_load"] = {"profile_foreign_cpus": profile_load, "run_foreign_cpus": run_load.cpus}
    classes = step_classes(replay_timer.kinds, replay_timer.batch_sizes)
    judge(validation, [TimedSteps(timed, replay_timer.predicted, cost.step_time, classes)], [measured["retimed_s"]], real_summary,
          *one_engine(sim_resolved, trace), before, speed, sim_resolved.device, thresholds, advice=backend.rerun_advice)
    validation["timing"]["wall_clock"] = {"steps_wall_s": measured["wall_s"], "steps_device_clock_s": sum(timed)}
    validation.update(
        profile=str(profile_path),
        series={"step_time": {"measured": timed, "predicted": replay_timer.predicted, "kind": replay_timer.kinds,
                              "batch_size": replay_timer.batch_sizes,
                              "single_run": measured["single_run_s"], "wall": measured["step_wall_s"]}},
    )
    return recorded(validation, config, backend, out_dir)


def timed_steps(run: SimRun) -> list[float]:
    """The durations of a run's timed steps (those the step timer ran), in order."""
    return [d for d, t in zip(run.steps.column("duration_s"), run.steps.column("timed")) if t]


def judge(validation: dict, engines: list[TimedSteps], passes: list[list[list[float]]], real_summary: dict, replay: Replay,
          at_speed: AtSpeed, before: SpeedCheck, after: SpeedCheck, device: DeviceProfile, thresholds: Thresholds,
          own: dict[str, tuple[float | None, float | None]] | None = None, *, advice: str) -> None:
    """Weigh the checks' misses against the machine and record how (docs/validate-verdict.md): the speed checks
    before and after the real run; each figure's real-vs-real spread, the engines' steps timed again (``passes``,
    one list an engine) and replayed; its least error with the model at the machine's speeds and at those times
    where the profile's fit landed against its own reference steps (``device``'s ratio; a biased copy keeps the
    original's). ``own``: a check's (spread, error at the machine's speed) measured its own way; ``advice``: what an
    inconclusive verdict tells the user to do (the backend's ``rerun_advice``)."""
    again = real_vs_real(engines, passes, real_summary, replay)
    moved = machine_speed(before, after, again["pass_speed"])
    fit = device.reference_fit_ratio
    explained = errors_at_speeds(engines, real_summary, moved.speeds_at_fit(fit), at_speed)
    for name, (spread, error) in (own or {}).items():
        again["spread"][name], explained[name] = spread, error
    validation["timing"].update(speed_check=after.to_dict(), speed_check_before=before.to_dict())
    validation["repeatability"] = {**again, "machine_speed": moved.to_dict(), "errors_at_machine_speed": explained,
                                   "profile_fit_ratio": fit, "profile_held_out_step_mape": device.held_out_step_mape}
    validation["verdict"] = verdict(validation["checks"], again["spread"], explained, moved.moved, thresholds, fit, advice,
                                    shared_differently(validation.get("host_load")),
                                    noisy_profile(device.held_out_step_mape, thresholds.step_mape)).to_dict()


def shared_differently(load: dict | None) -> str | None:
    """How other processes' load moved between the profile and the run, where it moved (the verdict's
    ``load_moved``); None where it did not or either reading is missing."""
    if load is None or not load_moved(load["profile_foreign_cpus"], load["run_foreign_cpus"]):
        return None
    return (f"{describe(load['profile_foreign_cpus'])} busy while the profile was measured and "
            f"{describe(load['run_foreign_cpus'])} during the run")


def recorded(validation: dict, config: RunConfig, backend: KernelBackend, out_dir: Path) -> dict:
    """``validation`` with the run's backend, KV dtype, clocks and config, written to validation.json."""
    validation.update(backend=backend.name, kv_dtype=resolve(config).memory.kv_dtype, clocks=clocks(backend.clock),
                      config=config.to_dict())
    (out_dir / "validation.json").write_text(json.dumps(validation, indent=2) + "\n")
    return validation


def one_device(config: RunConfig) -> RunConfig:
    """What a profile is measured and speed-checked on: the run's model on one device (a P/D pair's
    instance), or under tensor parallelism one rank's model (``rank_model_file``) on one device; the
    group's links and its ranks' compute beside one another come on top (``profile_for_group``)."""
    if config.disaggregated:  # a P/D pair's instances are each one device
        config = config.updated(prefill_instances=0, decode_instances=0)
    if config.tensor_parallel_size == 1:
        return config
    layout = ParallelLayout(config.tensor_parallel_size, enable_expert_parallel=config.enable_expert_parallel)
    return config.updated(model=rank_model_file(config.model, layout), tensor_parallel_size=1, enable_expert_parallel=False)


def reference_backend(backend: KernelBackend) -> KernelBackend:
    """The backend on the clock its profile was measured on: ``backend`` itself, except a tensor-parallel
    rank's wall-clock cpu backend, whose single-device steps the profile timed in thread CPU time."""
    return backend if backend.name != "cpu" or backend.clock.startswith(("thread", "process")) else open_backend("cpu")


def clocks(device_clock: str) -> dict[str, str]:
    """Which clock each figure of validation.json was measured on."""
    engine = f"the engine's clock: the running sum of step times measured on {device_clock}"
    return {
        "step_time": device_clock,
        "latency": engine,
        "throughput": engine,
        "noise_floor": device_clock,
        "speed_check": device_clock,
        "wall_time": WALL_CLOCK,
    }


def format_checks(validation: dict) -> str:
    """The closing summary: each check with its figure, limit and verdict, then what to read them against."""
    spread = validation["repeatability"]["spread"]
    lines = ["check                          value   limit   result   real-vs-real spread"]
    for c in validation["checks"]:
        value = "n/a" if c["value"] is None else f"{c['value']:.3f}"
        moved = "" if spread.get(c["name"]) is None else f"{spread[c['name']]:>10.3f}"  # timing checks only
        lines.append(f"{c['name']:<28}{value:>8}{c['threshold']:>8.3f}   {'pass' if c['passed'] else 'FAIL'}{moved}")
    passed = sum(c["passed"] for c in validation["checks"])
    lines.append(f"{passed} of {len(validation['checks'])} checks passed")
    clock = validation["clocks"]["step_time"]
    wall = validation["timing"]["wall_clock"]
    per_step = validation["timing"]["per_step"]
    lines.append(f"step times measured on {clock}, each the median of {per_step['timing_repeats']} runs of its forward pass: "
                 f"the real run's steps took {wall['steps_device_clock_s']:.2f} s on it, {wall['steps_wall_s']:.2f} s of wall clock "
                 "(first runs)")
    if per_step["timing_repeats"] > 1 and per_step["single_run"]["mape"] is not None:
        lines.append(f"per-step MAPE against each step's first run alone: {per_step['single_run']['mape']:.3f} (not a check)")
    noise = per_step.get("noise_floor")
    if noise is not None:
        lines.append(f"single-run step timing noise while profiling: {noise:.3f} (no model predicts single runs better than that)")
    by_batch = per_step["decode_by_batch_size"]
    if by_batch:
        ratios = ", ".join(f"{n}: {e['median_ratio']:.2f} ({e['steps']})" for n, e in by_batch.items())
        lines.append(f"decode steps by sequences in the batch, median measured / predicted (steps): {ratios}")
    speed = validation["timing"]["speed_check"]
    hint = " (the machine's speed changed since it was profiled: --reprofile)" if stale(speed["machine_ratio"], noise) else ""
    lines.append(f"speed check: reference steps took {speed['ratio']:.2f}x the profile's prediction ({reference_ratios(speed)})"
                 + (f", against their times when profiled {reference_ratios(speed, 'profiled_s')}" if speed.get("profiled_s") else "")
                 + hint)
    again = validation["repeatability"]
    speed = again["machine_speed"]
    lines.append(f"the machine's speed (reference steps over their time when profiled): {speed['before']:.2f}x before the run, "
                 f"{speed['after']:.2f}x after; the run's steps timed again in {again['passes']} passes: "
                 + ", ".join(f"{s:.2f}x" for s in again["pass_speed"]) + " their first measurement")
    if again.get("profile_fit_ratio") is not None:
        lines.append(f"the profile's reference steps, timed right after its cases, took {again['profile_fit_ratio']:.2f}x its fit's "
                     "prediction of them: the verdict weighs a miss with the model at that too")
    load = validation.get("host_load")
    if load is not None:
        lines.append(f"other processes kept {describe(load['profile_foreign_cpus'])} busy while the profile was measured, "
                     f"{describe(load['run_foreign_cpus'])} during the real run")
    links = validation["timing"].get("collectives")
    if links is not None:
        lines.append(f"the {links['ranks']} ranks' all-reduces, fitted after the run: {links['latency_s'] * 1e6:.0f} us latency, "
                     f"{links['bandwidth'] / 1e9:.2f} GB/s; against a second set timed in the same rounds (1-512 tokens' hidden "
                     f"states): median |error| {links['all_reduce_median_abs_error']:.1%}, at most "
                     f"{links['all_reduce_max_abs_error']:.1%}; the logits' all-gather (1-32 rows) "
                     f"{links['all_gather_median_abs_error']:.1%}, at most "
                     f"{links['all_gather_max_abs_error']:.1%}")
        steps = ", ".join(f"{label} {step['factor']:.2f}x" for label, step in links["reference_steps"].items())
        lines.append(f"a rank's work beside its peers' took, over what one device's did ({steps}; the reference steps less the "
                     f"group's collectives, each against the profile's prediction): memory-bound work and fixed costs "
                     f"{links['memory_factor']:.2f}x, compute-bound {links['compute_factor']:.2f}x, the factors the simulation's "
                     "operators take")
    transfers = validation.get("transfers")
    if transfers is not None:  # a P/D pair's (sim/cli/validate_pair.py)
        run, link = transfers["in_run"], transfers["link"]
        lines.append(f"KV transfers: {run['transfers']} in the run took {run['median_ratio']:.2f}x the fitted link's price "
                     f"(median; MAPE {run['mape']:.3f}); the link, fitted on the pair's channel timed before and after the "
                     f"run: {link['latency_s'] * 1e6:.0f} us + bytes / {link['bandwidth'] / 1e9:.2f} GB/s; the two timings "
                     f"{transfers['channel_spread']:.1%} apart (median over sizes)")
    decisions = validation["decision_identity"]
    identity = "identical" if decisions["identical"] else f"DIVERGE at step {decisions['first_divergence']['step']}"
    lines.append(f"decision logs: {identity} over {decisions['steps_compared']} steps")
    return "\n".join(lines)
