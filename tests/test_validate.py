"""kvsim validate, shortened: real run on the CPU, replay, free simulation, validation.json, report.

The timing thresholds are not asserted here (a loaded CI machine measures noise); the
benchmark in docs/benchmarks.md records the calibrated figures. What must hold anywhere:
the replay reproduces the real decision log, and the JSON carries every metric.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("plotly")

from click.testing import CliRunner  # noqa: E402

from kvsim.realexec.cli import REAL_DEFAULTS  # noqa: E402
from kvsim.realexec.cli_validate import cross_validate  # noqa: E402
from kvsim.realexec.validation import Thresholds, compare_decisions  # noqa: E402
from kvsim.sim.cli import main  # noqa: E402
from kvsim.sim.device import DEVICES_DIR, load_device, save_device  # noqa: E402
from kvsim.sim.run_config import load_run_trace  # noqa: E402

BASE_PROFILE = DEVICES_DIR / "cpu.toml"  # uncalibrated: fine for checking the machinery


@pytest.fixture(scope="module")
def validation(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("validate")
    config = REAL_DEFAULTS.updated(max_requests=10, num_blocks=48)  # a tight pool: preemptions happen
    validation = cross_validate(config, load_run_trace(config), "cpu", BASE_PROFILE, out, Thresholds())
    return validation, out


def test_replay_reproduces_the_real_decisions(validation):
    result, out = validation
    identity = result["decision_identity"]
    assert identity["identical"], identity["first_divergence"]
    real = (out / "real" / "decisions.jsonl").read_text()
    replay = (out / "replay" / "decisions.jsonl").read_text()
    assert real == replay
    assert identity["steps_compared"] == len(real.splitlines()) > 10
    assert result["memory"]["preemptions"]["real"] > 0


def test_validation_json_has_every_metric(validation):
    result, out = validation
    on_disk = json.loads((out / "validation.json").read_text())
    assert on_disk["decision_identity"] == result["decision_identity"]
    per_step = on_disk["timing"]["per_step"]
    assert {"mape", "p90_abs_error_s", "steps", "by_kind", "noise_floor"} <= set(per_step)
    assert per_step["noise_floor"] is None  # the bundled cpu profile was not measured on this machine
    speed = on_disk["timing"]["speed_check"]
    assert len(speed["labels"]) == len(speed["measured_s"]) == len(speed["predicted_s"]) == 3
    assert all(m > 0 for m in speed["measured_s"]) and all(p > 0 for p in speed["predicted_s"])
    ratios = sorted(m / p for m, p in zip(speed["measured_s"], speed["predicted_s"]))
    assert speed["ratio"] == pytest.approx(ratios[1])
    assert set(per_step["by_kind"]) <= {"prefill", "decode", "mixed"} and per_step["by_kind"]
    for metric in ("ttft_s", "tpot_s", "e2e_s"):
        for q in ("p50", "p99"):
            assert set(on_disk["timing"]["latency"][metric][q]) == {"real", "sim", "rel_error"}
    for key in ("throughput_tok_s", "makespan_s"):
        assert on_disk["timing"][key]["real"] > 0 and on_disk["timing"][key]["sim"] > 0
    memory = on_disk["memory"]
    assert memory["kv_pool_bytes"]["predicted"] == memory["kv_pool_bytes"]["measured"]
    assert {"peak_device_bytes", "peak_kv_blocks_used", "preemptions"} <= set(memory)
    names = {c["name"] for c in on_disk["checks"]}
    assert {"decision_identity", "step_mape", "ttft_p50_rel_error", "tpot_p50_rel_error"} <= names
    assert len(on_disk["series"]["step_time"]["predicted"]) == per_step["steps"]


def test_a_diverging_log_names_the_first_step():
    real = ['{"step":0,"entries":[]}', '{"step":1,"entries":[["a",0,1,"d",1]]}']
    sim = ['{"step":0,"entries":[]}', '{"step":1,"entries":[["b",0,1,"d",1]]}']
    result = compare_decisions(real, sim)
    assert not result["identical"]
    assert result["first_divergence"]["step"] == 1
    assert result["first_divergence"]["real"]["entries"][0][0] == "a"
    assert result["first_divergence"]["sim"]["entries"][0][0] == "b"


def test_validate_cli_fails_naming_the_failed_threshold_beside_the_noise_floor(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("max_requests = 4\n[validation]\nstep_mape = 0.0\n")
    profile = save_device(replace(load_device(BASE_PROFILE), step_timing_noise=0.2), tmp_path / "measured.toml")
    result = CliRunner().invoke(main, ["validate", "--config", str(config), "--profile", str(profile),
                                       "--out", str(tmp_path / "v")])
    assert result.exit_code == 1, result.output
    assert "validation failed: step_mape" in result.output
    assert "step timing noise while profiling: 0.200" in result.output
    assert "speed check: reference steps took " in result.output
    assert json.loads((tmp_path / "v" / "validation.json").read_text())["timing"]["per_step"]["noise_floor"] == 0.2
    assert (tmp_path / "v" / "report.html").exists()
    assert (tmp_path / "v" / "validation.json").exists()


def test_calibrated_profiles_are_cached_per_machine_and_profiler_version(tmp_path, monkeypatch):
    from kvsim.realexec import calibration

    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path))
    runs: list[Path] = []
    monkeypatch.setattr("kvsim.realexec.profiler.run_profile", lambda backend, model, out, **kw: runs.append(Path(out)))
    path = calibration.calibrated_profile("cpu", "tiny")
    assert runs == [path] and path.parent == tmp_path / "profiles"
    path.write_text("cached")
    assert calibration.calibrated_profile("cpu", "tiny") == path and len(runs) == 1  # reused, not measured again
    monkeypatch.setattr(calibration, "PROFILER_VERSION", calibration.PROFILER_VERSION + 1)
    assert calibration.calibrated_profile("cpu", "tiny") != path and len(runs) == 2  # a newer profiler measures anew
