"""The decision log: the diff-encoded full log expands back to the reference lines byte for
byte, digests compare runs, and the CLI writes and shows what it says."""

from __future__ import annotations

import gzip
import json

import pytest
from click.testing import CliRunner

from kvsim import traces
from kvsim.cli.main import main
from kvsim.policies.plan import BatchChanges, DecodeStretch, PlanDetail, PlanEntry, StepPlan
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import RunConfig, resolve
from kvsim.sim.run.decisions import (
    DIGEST,
    FULL_LOG,
    DecisionLog,
    DiffEncoder,
    decode_records,
    read_decisions,
    read_digest,
)
from kvsim.sim.run.simulator import SimOptions, simulate


class Tee:
    """A DecisionLog and, with ``whole`` plans (the engine writes every plan whole for this sink),
    the reference lines (``to_json``) of the same run."""

    def __init__(self, log: DecisionLog, whole: bool) -> None:
        self.log, self.lines, self.told_by_changes = log, [], 0
        self.plan_detail = PlanDetail.TABLES if whole else PlanDetail.CHANGES

    def plan(self, plan) -> None:
        if not isinstance(plan.batch, BatchChanges):
            self.lines.append(plan.to_json())
        else:
            self.told_by_changes += 1
        self.log.plan(plan)


def logged_run(trace, out, mode="full", whole_plans=False, **overrides) -> tuple[Tee, dict]:
    resolved = resolve(RunConfig(**overrides))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    tee = Tee(DecisionLog(mode, resolved.engine_config.block_size, out), whole=whole_plans)
    timer = CostModelTimer(resolved.cost_model())
    run = simulate(trace, resolved.new_engine(), timer, SimOptions(decisions=tee))
    digest = tee.log.close()
    assert digest["steps"] == len(run.steps)
    return tee, digest


FORKS = traces.synthesize(n_requests=60, rate=40.0, prompt=traces.Uniform(50, 400), output=traces.Uniform(5, 120),
                          n_samples=3, seed=3)
TINY = dict(model="tiny", device="cpu", block_size=16, max_model_len=1024)


@pytest.mark.parametrize(
    "trace, overrides",
    [
        # forks and copy-on-write, swap preemption
        (FORKS, dict(TINY, block_manager="prefix", num_blocks=120, preemption_mode="swap", swap_space_gb=0.001)),
        # recompute preemption: tables replaced, requests leaving and coming back
        (FORKS, dict(TINY, block_manager="paged", num_blocks=90, preemption_mode="recompute")),
        # chunked prefills (kept entries that are not decodes), rejections at arrival
        (traces.first(traces.load_named("azure_conv_10min"), 300),
         dict(scheduler="chunked", block_manager="prefix", num_blocks=300, block_size=16, max_num_batched_tokens=512,
              max_waiting=20)),
        # a policy that reorders the queue, contiguous reservations
        (traces.first(traces.load_named("azure_conv_10min"), 200),
         dict(scheduler="sjf", block_manager="contiguous", num_blocks=3000, block_size=16, max_model_len=4096)),
    ],
)
def test_full_log_expands_to_the_reference_lines(tmp_path, trace, overrides):
    """The simulator's log (told what changed in the batch) holds the same records as a log of
    the whole plans of the same run, and expands to their reference lines byte for byte."""
    whole, whole_digest = logged_run(trace, None, whole_plans=True, **overrides)
    told, digest = logged_run(trace, tmp_path, **overrides)
    reference = whole.lines
    assert len(reference) == whole_digest["steps"]
    assert list(read_decisions(tmp_path)) == reference
    assert digest == whole_digest  # the same records, byte for byte
    stored = (tmp_path / FULL_LOG).stat().st_size
    assert stored * 10 < sum(len(line) + 1 for line in reference)  # diff + gzip: far smaller than the lines
    assert read_digest(tmp_path) == digest
    batching = overrides.get("scheduler") != "chunked"  # it reorders the running requests: every plan is whole
    assert (told.told_by_changes > len(reference) / 2) if batching else told.told_by_changes == 0


def test_the_log_covers_what_it_claims_to():
    """The cases above exercise what they are there for: forks, copies, swaps, preemptions."""
    whole, _ = logged_run(FORKS, None, whole_plans=True, **dict(TINY, block_manager="prefix", num_blocks=120,
                                                                preemption_mode="swap", swap_space_gb=0.001))
    plans = [json.loads(line) for line in whole.lines]
    for key in ("forks", "copies", "swap_out", "swap_in", "preempted"):
        assert any(s[key] for s in plans), key


def test_summary_digest_equals_the_full_one_and_tells_runs_apart(tmp_path):
    config = dict(TINY, block_manager="prefix", num_blocks=120)
    _, full = logged_run(FORKS, tmp_path / "full", **config)
    _, summary = logged_run(FORKS, None, mode="summary", **config)
    _, other = logged_run(FORKS, None, mode="summary", **dict(config, num_blocks=100))
    assert {k: v for k, v in full.items() if k != "mode"} == {k: v for k, v in summary.items() if k != "mode"}
    assert summary["mode"] == "summary" and full["mode"] == "full"
    assert other["sha256"] != summary["sha256"]


def _plan(step, entries, tables, slots, **rest) -> StepPlan:
    entries = [PlanEntry(*e) for e in entries]
    return StepPlan(step=step, entries=entries, block_tables=tables, slot_mapping=slots, **rest)


def test_plans_outside_the_expected_shape_round_trip():
    """Reordered batches, tables not in entry order, slots the tables do not imply, skipped steps:
    stored literally where the diff cannot express them, and expanded exactly; a decode-stretch
    record (as versions that macro-stepped wrote them) is expanded too."""
    plans = [
        _plan(0, [("a", 0, 4, True, True), ("b", 0, 2, True, False)], {"a": [5], "b": [7]}, [20, 21, 22, 23, 28, 29]),
        _plan(1, [("b", 2, 1, True, True), ("a", 4, 1, False, True)], {"b": [7], "a": [5, 9]}, [30, 36]),
        _plan(2, [("a", 5, 1, False, True), ("b", 3, 1, False, True)], {"b": [7], "a": [5, 9]}, [37, 31]),
        _plan(3, [("a", 6, 1, False, True), ("b", 4, 1, False, True)], {"a": [5, 9], "b": [3, 8]}, [38, 99],
              copies=[(7, 3)], preempted=[("c", "swap")], rejected=[("d", "queue_full")], forks=[("a", ["a.1"])]),
        _plan(7, [], {}, [], swap_out=[(1, 0)]),
        _plan(8, [("b", 0, 1, True, False)], {"b": [1]}, [4]),
    ]
    stretch = DecodeStretch(first_step=9, num_steps=3, block_size=4, request_ids=["b"], start_positions=[1],
                            start_tables={"b": [1]}, growth=[(2, "b", 6)])
    after = _plan(12, [("b", 4, 1, False, True)], {"b": [1, 6]}, [24])
    encoder = DiffEncoder(block_size=4)
    # The step after a stretch, as those versions wrote it: exactly what the stretch implies.
    records = [encoder.header(), *(encoder.plan(p) for p in plans), '{"S":' + stretch.to_json() + "}", "{}"]
    expected = [p.to_json() for p in plans] + [stretch.to_json(), after.to_json()]
    assert list(decode_records(records)) == expected
    assert '"m"' in records[4]  # a slot the tables do not imply is kept as given


def test_simulate_cli_log_modes_and_show(tmp_path):
    runner = CliRunner()
    base = ["simulate", "--trace", "demo", "--model", "tiny", "--device", "cpu", "--quiet"]
    for mode in ("off", "summary", "full"):
        result = runner.invoke(main, [*base, "--decisions", mode, "--out", str(tmp_path / mode)])
        assert result.exit_code == 0, result.output
    assert not (tmp_path / "off" / DIGEST).exists() and not (tmp_path / "off" / FULL_LOG).exists()
    assert (tmp_path / "summary" / DIGEST).exists() and not (tmp_path / "summary" / FULL_LOG).exists()
    assert read_digest(tmp_path / "summary")["sha256"] == read_digest(tmp_path / "full")["sha256"]

    shown = runner.invoke(main, ["decisions", "show", str(tmp_path / "full")])
    assert shown.exit_code == 0
    with gzip.open(tmp_path / "full" / FULL_LOG, "rt") as fh:
        assert shown.output.splitlines() == list(decode_records(fh))
    per_step = runner.invoke(main, ["decisions", "show", "--per-step", str(tmp_path / "full")]).output.splitlines()
    assert [json.loads(line)["step"] for line in per_step] == list(range(read_digest(tmp_path / "full")["steps"]))

    missing = runner.invoke(main, ["decisions", "show", str(tmp_path / "summary")])
    assert missing.exit_code != 0 and "run with --decisions full" in missing.output


def test_reader_takes_a_log_written_before_the_diff_encoding(tmp_path):
    lines = [_plan(0, [("a", 0, 2, True, True)], {"a": [0]}, [0, 1]).to_json(),
             DecodeStretch(1, 2, 4, ["a"], [2], {"a": [0]}, []).to_json()]
    (tmp_path / "decisions.jsonl").write_text("".join(line + "\n" for line in lines))
    assert list(read_decisions(tmp_path)) == lines
    assert len(list(read_decisions(tmp_path, per_step=True))) == 3
