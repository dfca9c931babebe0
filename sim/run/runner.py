"""Run a trace through the engine with some step timer and write the run's directory.

``kvsim simulate`` (cost model), ``kvsim execute`` (real executor) and ``kvsim validate``
(both, and a replay) all come through here, so every run directory has the same files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvsim.sim.parallel.rank_cost import ParallelCostModel
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.perf.step_timer import StepTimer
from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.decisions import DecisionLog
from kvsim.sim.run.outputs import write_requests, write_steps, write_summary
from kvsim.sim.run.run_warnings import run_warnings
from kvsim.sim.run.simulator import SimOptions, SimRun, cyclic_gc_paused, simulate
from kvsim.traces.schema import Trace


def run_trace(
    resolved: ResolvedRun,
    trace: Trace,
    timer: StepTimer,
    out_dir: Path | None,
    *,
    check: bool = False,
    progress: bool = False,
    label: str = "simulate",
    summary_extras: Callable[[SimRun], dict] | None = None,
    decisions: str = "summary",
) -> tuple[SimRun, dict]:
    """Replay ``trace`` with ``timer``; with ``out_dir``, write summary/requests/steps/decisions there.

    ``summary_extras`` adds what only the caller knows (e.g. measured memory) to the summary.
    ``decisions``: off | summary (a digest) | full (the diff-encoded log), see ``sim.run.decisions``.
    """
    engine = resolved.new_engine()
    log = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if decisions != "off":
            log = DecisionLog(decisions, resolved.engine_config.block_size, out_dir)
    bar = _progress_bar(len(trace), label) if progress else None
    with cyclic_gc_paused():
        try:
            options = SimOptions(check=check, decisions=log, on_progress=bar.update if bar is not None else None)
            run = simulate(trace, engine, timer, options)
        finally:
            if bar is not None:
                bar.close()
            if log is not None:
                log.close()
        summary = run.summary()
        if summary_extras is not None:
            summary.update(summary_extras(run))
        summary["trace"] = {"source": trace.source, "rows": len(trace), "notes": list(trace.notes)}
        if isinstance(timer, CostModelTimer) and isinstance(timer.cost_model, ParallelCostModel):
            summary["parallel"] = timer.cost_model.summary()  # the layout's collectives over the run
        summary["config"] = resolved.to_dict()
        summary["memory"] = resolved.memory.to_dict()
        summary["warnings"] = run_warnings(resolved, trace, summary, run.records.requests)
        if out_dir is not None:
            write_summary(out_dir, summary)
            write_requests(out_dir, run.records.requests)
            write_steps(out_dir, run.steps)
    return run, summary


def _progress_bar(total: int, label: str):
    """A tqdm bar over requests; imported here because a quiet run need not pay tqdm's import (about 30 ms)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", leave=False, mininterval=0.5)
