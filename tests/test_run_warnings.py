"""Warnings a user needs, printed and kept in summary.json: rejections, overload, a queue that
keeps growing, swap asked for without swap space; a healthy run has none."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvsim.cli.main import main


def _simulate(tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["simulate", "--quiet", "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    return {w["kind"]: w for w in summary["warnings"]}, result.output


def test_a_healthy_run_has_no_warnings(tmp_path):
    warnings, output = _simulate(tmp_path, "--trace", "demo")
    assert warnings == {} and "warning" not in output


def test_rejections_are_counted_with_their_reasons(tmp_path):
    warnings, output = _simulate(tmp_path, "--trace", "demo", "--max-model-len", "300")
    rejected = warnings["rejected"]
    assert rejected["count"] > 0 and rejected["reasons"] == {"exceeds_max_model_len": rejected["count"]}
    assert 0 < rejected["share"] < 1
    assert f"warning: {rejected['message']}" in output and "exceeds_max_model_len" in output


def test_overload_and_a_growing_queue_are_flagged(tmp_path):
    warnings, output = _simulate(tmp_path, "--trace", "azure_conv_10min", "--max-requests", "60", "--request-rate", "30",
                                 "--num-gpu-blocks-override", "200", "--block-size", "16")
    assert warnings["overload"]["duration_s"] > 2 * warnings["overload"]["trace_span_s"]
    assert warnings["unbounded_queue"]["slope_s_per_s"] > 0.05
    assert "cannot keep up" in output and "grows without bound" in output


def test_swap_without_swap_space_is_flagged(tmp_path):
    warnings, output = _simulate(tmp_path, "--trace", "demo", "--preemption-mode", "swap", "--swap-space", "0",
                                 "--num-gpu-blocks-override", "48", "--block-size", "16", "--rate-scale", "5")
    swap = warnings["swap_without_space"]
    assert swap["preemptions"] > 0 and "recomputes instead" in output
