"""Run directories are complete or absent: a run killed midway never leaves one marked complete,
and an old run being overwritten stays whole until the new one replaces it."""

from __future__ import annotations

import csv
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvsim import traces
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import RunConfig, resolve
from kvsim.sim.run.metrics import STEP_COLUMNS, StepLog
from kvsim.sim.run.outputs import STEPS, SUMMARY, atomic_open, format_summary, write_steps
from kvsim.sim.run.run_dir import COMPLETE, is_complete, staged_dir
from kvsim.sim.run.simulator import SimOptions, simulate

# --check makes the run slow enough (seconds of CPU) to be killed in the middle
SLOW_RUN = ["simulate", "--trace", "mooncake_500", "--check", "--quiet"]


def _kvsim(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from kvsim.cli.main import main; main()", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill_midway(proc: subprocess.Popen, parent: Path, sig: int) -> None:
    deadline = time.monotonic() + 60
    while not any(parent.glob(".run.partial-*")):  # the run has started
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the run never started writing"
        time.sleep(0.05)
    time.sleep(0.5)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_killed_run_leaves_no_directory_marked_complete(tmp_path, sig):
    proc = _kvsim(*SLOW_RUN, "--out", str(tmp_path / "run"))
    _kill_midway(proc, tmp_path, sig)
    assert proc.returncode != 0
    assert not (tmp_path / "run").exists()
    assert not [p for p in tmp_path.rglob(COMPLETE)]


def test_an_interrupted_overwrite_keeps_the_old_run_whole(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", "from kvsim.cli.main import main; main()", "simulate", "--trace", "demo",
                           "--quiet", "--out", str(out)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert is_complete(out) and SUMMARY in before
    proc = _kvsim(*SLOW_RUN, "--overwrite", "--out", str(out))
    _kill_midway(proc, tmp_path, signal.SIGKILL)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_staged_dir_is_renamed_only_on_success(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with staged_dir(out) as tmp:
            (tmp / "half.csv").write_text("a,b\n")
            raise RuntimeError("stop")
    assert not out.exists() and not list(tmp_path.iterdir())
    with staged_dir(out) as tmp:
        (tmp / "whole.csv").write_text("a,b\n")
    assert is_complete(out) and (out / "whole.csv").exists()


def test_atomic_open_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(ValueError):
        with atomic_open(path) as fh:
            fh.write("new, half")
            raise ValueError("disk full")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_summary_table_switches_to_seconds_for_long_latencies():
    fast = {"mean": 0.05, "p50": 0.04, "p90": 0.08, "p99": 0.1}
    slow = {"mean": 300.0, "p50": 250.0, "p90": 600.0, "p99": 671.862}
    summary = {"requests_completed": 1, "requests_rejected": 0, "duration_s": 1.0, "request_rate_rps": 1.0, "throughput_tok_s": 1.0,
               "preemptions": 0, "prefix_hit_rate": 0.5, "peak_kv_blocks_used": 1, "num_kv_blocks": 2, "mean_kv_usage": 0.5,
               "ttft_s": slow, "tpot_s": fast, "itl_s": fast, "e2e_s": slow}
    table = format_summary(summary)
    assert "P99 TTFT (s):                               671.86" in table and "P99 TPOT (ms):" in table
    assert "Prefix hit rate (%):" in table and "671862" not in table


def test_gap_percentiles_from_counts_are_numpys_on_the_repeated_gaps_to_the_last_bit():
    """The ITL figures come from distinct gaps and their counts: the percentiles must equal
    numpy's on every gap repeated (a decode batch's runs, one-by-one tokens, ties, one gap, a
    percentile landing on a run's edge); the mean may differ only in rounding, and not at all
    between two groupings of the same gaps."""
    from kvsim.sim.run.metrics import TokenTimes, distribution, distribution_of_counts

    times = TokenTimes()
    for end in [0.5, 0.75, 1.0, 1.5, 1.75, 2.5, 2.625, 3.0]:
        times.step_ended(end)
    times.batch_tokens("a", 0, 6)
    times.batch_tokens("b", 2, 7)
    times.token("c", 0.5)
    times.token("c", 2.0)
    times.token("c", 2.25)
    gaps = times.compact_gaps()
    assert len(times.all_gaps()) == 6 + 5 + 2
    rng = np.random.default_rng(7)
    cases = [(gaps.values, gaps.counts), (np.array([0.25]), np.array([1])), (np.array([0.5, 0.25]), np.array([1, 1])),
             (np.array([0.1, 0.3, 0.2]), np.array([1, 99, 1])), (np.array([0.4, 0.4, 0.1]), np.array([50, 50, 1])),
             (np.array([0.888, 0.226]), np.array([4, 4])),  # numpy interpolates from above here: a + d t != b - d (1 - t)
             (rng.random(300), rng.integers(1, 40, 300)), (np.round(rng.random(500), 2), rng.integers(1, 5, 500))]
    for values, counts in cases:
        expected = distribution(np.repeat(values, counts))
        got = distribution_of_counts(values, counts)
        assert {k: v for k, v in got.items() if k != "mean"} == {k: v for k, v in expected.items() if k != "mean"}
        assert got["mean"] == pytest.approx(expected["mean"], rel=1e-12)
    assert distribution_of_counts(np.empty(0), np.empty(0, dtype=np.int64)) == distribution([])
    values, counts = cases[-2]
    regrouped = distribution_of_counts(np.repeat(values, counts), np.ones(counts.sum(), dtype=np.int64))
    assert regrouped == distribution_of_counts(values, counts)  # the mean too: grouping is not a figure's input


def test_distribution_leaves_the_callers_values_alone():
    from kvsim.sim.run.metrics import distribution

    values = np.random.default_rng(3).random(1001)
    ordered = np.sort(values)
    expected = {"mean": float(ordered.mean()),
                **{f"p{p}": float(v) for p, v in zip((50, 90, 99), np.percentile(ordered, (50, 90, 99)))}}
    given = values.copy()
    assert distribution(given) == expected and np.array_equal(given, values)
    assert distribution(list(values)) == expected


def _csv_module_steps(rows: list[tuple]) -> str:
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(STEP_COLUMNS)
    writer.writerows(rows)
    return buffer.getvalue()


def test_steps_csv_is_what_the_csv_module_writes(tmp_path):
    """steps.csv of a simulated run is formatted row by row without the csv module; the bytes must
    be the module's: a demo run (every step kind), an idle step, floats that repr in exponent form,
    and a log with measured fields (which the module writes itself)."""
    resolved = resolve(RunConfig(trace="demo"))
    run = simulate(traces.load_named("demo"), resolved.new_engine(), CostModelTimer(resolved.cost_model()), SimOptions())
    rows = run.steps.rows() + [(len(run.steps), 1e-05, 0.0, 0, "idle", 0, 0, 0, 0, 0, 64, 0, 0, 0, 0, None, None, None),
                             (len(run.steps) + 1, 12345678.9, 1.5e-07, 1, "decode", 1, 0, 1, 1, 0, 63, 127, 0, 0, 0, None, None, None)]
    assert {row[4] for row in rows} >= {"prefill", "decode", "mixed", "idle"}
    simulated = tmp_path / "simulated"
    simulated.mkdir()
    log = StepLog()
    log.add_rows(rows)
    write_steps(simulated, log)
    assert (simulated / STEPS).read_bytes().decode() == _csv_module_steps(rows)
    measured_rows = rows[:3] + [(*rows[3][:15], 0.004, 0.001, 123456)]
    measured = tmp_path / "measured"
    measured.mkdir()
    log = StepLog()
    log.add_rows(measured_rows)
    write_steps(measured, log)
    assert (measured / STEPS).read_bytes().decode() == _csv_module_steps(measured_rows)


def test_a_step_log_kept_in_chunks_reads_back_every_row_as_logged(tmp_path, monkeypatch):
    """Rows become record arrays every CHUNK_STEPS (here 5): kinds, None (not measured), whole byte
    counts and floats come back as logged, also for rows added after the table was read; and a
    cluster's steps.csv (rows gathered in another order, an instance column) is the csv module's."""
    monkeypatch.setattr(StepLog, "CHUNK_STEPS", 5)
    resolved = resolve(RunConfig(trace="demo"))
    run = simulate(traces.load_named("demo"), resolved.new_engine(), CostModelTimer(resolved.cost_model()), SimOptions())
    rows = run.steps.rows()
    rows[7] = (*rows[7][:15], 0.004, 1.5e-07, 123456)  # a measured step among simulated ones
    log = StepLog()
    log.add_rows(rows[:12])
    assert log.rows() == rows[:12] and len(log.table()) == 12
    log.add_rows(rows[12:])  # after the table was read
    assert len(log) == len(rows) and log.rows() == rows
    assert log.column("memory_bytes")[7] == 123456 and isinstance(log.column("memory_bytes")[7], int)
    order = np.arange(len(rows))[::-1].copy()
    instance = np.arange(len(rows)) % 3
    write_steps(tmp_path, log.table(), instance, order)
    expected = [(*rows[i], int(instance[i])) for i in order]
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow((*STEP_COLUMNS, "instance"))
    writer.writerows(expected)
    assert (tmp_path / STEPS).read_bytes().decode() == buffer.getvalue()
