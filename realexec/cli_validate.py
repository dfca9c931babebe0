"""``kvsim validate``: run one trace on the device and in the simulator, and compare.

With no arguments: the bundled demo trace, the tiny model, the CPU backend, a cost model
calibrated for this machine (profiled on the spot and cached when none fits), and a report.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import click

from kvsim.realexec.calibration import calibrated_profile
from kvsim.realexec.cli import REAL_DEFAULTS, execute_run, for_backend
from kvsim.realexec.speed_check import speed_check
from kvsim.realexec.validation import Thresholds, compare_decisions, validate_runs
from kvsim.sim.cli_options import run_config_from, run_options
from kvsim.sim.cost_model import CostModelTimer
from kvsim.sim.outputs import DECISIONS
from kvsim.sim.run_config import load_run_trace, resolve
from kvsim.sim.runner import run_trace
from kvsim.sim.simulator import SimOptions, simulate
from kvsim.sim.step_timer import ReplayTimer


@click.command()
@run_options
@click.option("--backend", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True)
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Calibrated device profile (from kvsim profile); default: this machine's cached one, else profile now.")
@click.option("--reprofile", is_flag=True, help="Profile this machine again even if a cached profile fits.")
@click.option("--out", "out_dir", default=Path("runs/validate"), show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Where the runs, validation.json and report.html go.")
@click.option("--quiet", is_flag=True)
def validate(backend: str, profile_path: Path | None, reprofile: bool, out_dir: Path, quiet: bool, **options) -> None:
    """Cross-validate the simulator against the real executor on the same trace."""
    config_path = options.get("config_path")
    try:
        thresholds = Thresholds.from_toml(config_path)
        config = run_config_from(options, base=REAL_DEFAULTS)
        trace = load_run_trace(config)
        if profile_path is None:
            profile_path = calibrated_profile(backend, config.model, refresh=reprofile, echo=None if quiet else click.echo)
        validation = cross_validate(config, trace, backend, profile_path, out_dir, thresholds, progress=not quiet)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise click.ClickException(str(exc).strip("'\"")) from None

    from kvsim.reports.validation import write_validation_report

    report = write_validation_report(validation, {k: out_dir / k for k in ("real", "sim", "replay")}, out_dir / "report.html")
    if not quiet:
        click.echo(format_checks(validation))
    if not validation["passed"]:
        failed = ", ".join(c["name"] for c in validation["checks"] if not c["passed"])
        click.echo(f"report: {report}")
        raise click.ClickException(f"validation failed: {failed}")
    click.echo(f"report: {report}")


def cross_validate(config, trace, backend: str, profile_path: Path, out_dir: Path, thresholds: Thresholds,
                   progress: bool = False) -> dict:
    """The three runs (real, replay, free simulation) and their comparison; writes validation.json."""
    config = for_backend(config, backend)
    real, real_summary = execute_run(config, backend, out_dir / "real", progress=progress)

    sim_resolved = resolve(config.updated(device=str(profile_path), num_blocks=real.engine.config.num_blocks))
    cost = sim_resolved.cost_model()

    timed = [d for d, t in zip(real.steps.columns["duration_s"], real.steps.columns["timed"]) if t]
    replay_timer = ReplayTimer(timed, predict=cost.step_time)
    replay_log = io.StringIO()
    simulate(trace, sim_resolved.new_engine(), replay_timer, SimOptions(exact=True, decisions=replay_log))
    (out_dir / "replay").mkdir(parents=True, exist_ok=True)
    (out_dir / "replay" / DECISIONS).write_text(replay_log.getvalue())
    real_lines = (out_dir / "real" / DECISIONS).read_text().splitlines()
    decisions = compare_decisions(real_lines, replay_log.getvalue().splitlines())

    speed = speed_check(backend, cost, seed=config.seed)  # right after the real run: the machine as it ran
    _, sim_summary = run_trace(sim_resolved, trace, CostModelTimer(cost), out_dir / "sim", exact=True, progress=progress)

    memory = resolve(config).memory  # what the memory model says the real run's device holds
    kv_pool = real.engine.config.num_blocks * memory.bytes_per_block
    validation = validate_runs(real, real_summary, sim_summary, decisions, replay_timer.predicted, replay_timer.kinds,
                               kv_pool, memory.weight_bytes + memory.activation_bytes + kv_pool, thresholds)
    validation["timing"]["per_step"]["noise_floor"] = sim_resolved.device.step_timing_noise
    validation["timing"]["speed_check"] = speed.to_dict()
    validation.update(
        backend=backend,
        profile=str(profile_path),
        config=config.to_dict(),
        series={"step_time": {"measured": timed, "predicted": replay_timer.predicted, "kind": replay_timer.kinds}},
    )
    (out_dir / "validation.json").write_text(json.dumps(validation, indent=2) + "\n")
    return validation


def format_checks(validation: dict) -> str:
    lines = ["check                          value   limit   result"]
    for c in validation["checks"]:
        value = "n/a" if c["value"] is None else f"{c['value']:.3f}"
        lines.append(f"{c['name']:<28}{value:>8}{c['threshold']:>8.3f}   {'pass' if c['passed'] else 'FAIL'}")
    noise = validation["timing"]["per_step"].get("noise_floor")
    if noise is not None:
        lines.append(f"step timing noise while profiling: {noise:.3f} (no model predicts single steps better than that)")
    ratio = validation["timing"]["speed_check"]["ratio"]
    lines.append(f"speed check: reference steps took {ratio:.2f}x the profile's prediction"
                 + (" (the machine's speed changed since it was profiled: --reprofile)" if abs(ratio - 1) > max(noise or 0, 0.1) else ""))
    decisions = validation["decision_identity"]
    lines.append(f"decision logs: {'identical' if decisions['identical'] else 'DIVERGE at step ' + str(decisions['first_divergence']['step'])}"
                 f" over {decisions['steps_compared']} steps")
    return "\n".join(lines)
