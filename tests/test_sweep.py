"""kvsim sweep: the grid expands, each configuration is its own run, sweep.csv holds them all."""

from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

from kvsim.cli.main import main
from kvsim.reports.compare import seconds
from kvsim.sim.run.config import RunConfig
from kvsim.sim.studies.sweep import expand_grid


def test_grid_is_the_cartesian_product():
    configs = {name: config for name, _, config in expand_grid(RunConfig(), {"block_size": [16, 128], "kv_cache_dtype": ["bf16", "int8"]})}
    assert sorted(configs) == ["block_size=128,kv_cache_dtype=bf16", "block_size=128,kv_cache_dtype=int8",
                               "block_size=16,kv_cache_dtype=bf16", "block_size=16,kv_cache_dtype=int8"]
    assert configs["block_size=16,kv_cache_dtype=int8"].kv_dtype == "int8"
    assert configs["block_size=16,kv_cache_dtype=int8"].block_size == 16


def test_sweep_runs_every_configuration_in_worker_processes(tmp_path):
    sweep_file = tmp_path / "sweep.toml"
    sweep_file.write_text('trace = "demo"\nmodel = "llama-2-7b"\nnum_blocks = 60\n[grid]\nblock_size = [16, 32]\n'
                          'kv_dtype = ["bf16", "int8"]\n')
    result = CliRunner().invoke(main, ["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--jobs", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((tmp_path / "out" / "sweep.csv").open()))
    assert [r["name"] for r in rows] == ["block_size=16,kv_dtype=bf16", "block_size=16,kv_dtype=int8",
                                         "block_size=32,kv_dtype=bf16", "block_size=32,kv_dtype=int8"]
    assert all(int(r["requests_completed"]) == 41 for r in rows)
    assert [(r["block_size"], r["kv_dtype"]) for r in rows] == [("16", "bf16"), ("16", "int8"), ("32", "bf16"), ("32", "int8")]
    for row in rows:
        assert (tmp_path / "out" / row["name"] / "summary.json").exists()
        assert (tmp_path / "out" / row["name"] / "COMPLETE").exists()
    # fewer tokens per block means more blocks in use at peak for the same traffic
    peak = {r["name"]: int(r["peak_kv_blocks_used"]) for r in rows}
    assert peak["block_size=16,kv_dtype=bf16"] > peak["block_size=32,kv_dtype=bf16"]
    # report compare takes the sweep directory for its four points
    compared = CliRunner().invoke(main, ["report", "compare", str(tmp_path / "out"), "--out", str(tmp_path / "cmp")])
    assert compared.exit_code == 0, compared.output
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["run_dir"] for r in report["runs"]] == [str(tmp_path / "out" / r["name"]) for r in rows]
    assert len({r["label"] for r in report["runs"]}) == 4


def test_latencies_read_in_seconds_when_large():
    assert seconds(0.0123) == "12.3 ms" and seconds(1.5) == "1.50 s" and seconds(671.862) == "672 s"


def test_sweep_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('trace = "demo"\n[grid]\nblock_sizes = [16]\n')
    result = CliRunner().invoke(main, ["sweep", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert "bad.toml" in result.output and "block_sizes" in result.output


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    sweep_file = tmp_path / "sweep.toml"
    # block size 100 cannot map the demo trace's 32-token prefix hashes: that point fails
    sweep_file.write_text('trace = "demo"\nnum_gpu_blocks_override = 60\n[grid]\nblock_size = [16, 100]\n')
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["sweep", str(sweep_file), "--out", str(out), "--jobs", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    rows = {r["block_size"]: r for r in csv.DictReader((out / "sweep.csv").open())}
    assert rows["16"]["status"] == "ok" and int(rows["16"]["requests_completed"]) == 41
    assert rows["100"]["status"] == "failed" and "hash block size" in rows["100"]["error"]
    assert "block_size=100 failed" in result.output
    again = CliRunner().invoke(main, ["sweep", str(sweep_file), "--out", str(out), "--quiet"])
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_grid_values_are_type_checked(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('trace = "demo"\n[grid]\nblock_size = [16, "32"]\n')
    result = CliRunner().invoke(main, ["sweep", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "bad.toml [grid]: block_size = '32': expected an integer" in result.output


def test_a_joint_key_varies_its_fields_together(tmp_path):
    from pathlib import Path

    import pytest

    from kvsim.sim.studies.sweep import load_grid_file

    example = Path(__file__).resolve().parents[1] / "examples" / "capacity_deepseek_layouts.toml"
    base, grid, _ = load_grid_file(example, require_grid=False)
    points = list(expand_grid(base, grid))
    layouts = [(c.device, c.tensor_parallel_size, c.data_parallel_size) for _, _, c in points]
    assert len(points) == 6 and all(tp * dp == 16 for _, tp, dp in layouts)
    assert points[0][1] == {"device": "ascend-910b3", "tensor_parallel_size": 16, "data_parallel_size": 1}
    bad = tmp_path / "bad.toml"
    bad.write_text('[grid]\n"tensor_parallel_size,data_parallel_size" = [[8, 2], [16]]\n')
    with pytest.raises(ValueError, match="one per field"):
        load_grid_file(bad)


def test_a_cluster_point_runs_as_kvsim_simulate_runs_it(tmp_path):
    """instances / router in a sweep: each point is the cluster that ``kvsim simulate`` runs, router and all."""
    common = 'trace = "mooncake_500"\nmodel = "qwen2.5-7b"\nmax_model_len = 131072\nmax_requests = 150\ninstances = 3\n'
    sweep_file = tmp_path / "sweep.toml"
    sweep_file.write_text(common + '[grid]\nrouter = ["round-robin", "kv-aware"]\n')
    result = CliRunner().invoke(main, ["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--jobs", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    rows = {r["router"]: r for r in csv.DictReader((tmp_path / "out" / "sweep.csv").open())}
    for router, row in rows.items():
        run = tmp_path / router
        simulated = CliRunner().invoke(main, ["simulate", "--trace", "mooncake_500", "--model", "qwen2.5-7b", "--max-model-len",
                                              "131072", "--max-requests", "150", "--instances", "3", "--router", router,
                                              "--quiet", "--decisions", "off", "--out", str(run)])
        assert simulated.exit_code == 0, simulated.output
        summary = json.loads((run / "summary.json").read_text())
        assert float(row["prefix_hit_rate"]) == pytest.approx(summary["prefix_hit_rate"], rel=1e-12)
        assert float(row["ttft_s_p50"]) == pytest.approx(summary["ttft_s"]["p50"], rel=1e-12)
        point = json.loads((tmp_path / "out" / row["name"] / "summary.json").read_text())
        assert point["router"]["name"] == router and len(point["instances"]) == 3
    assert rows["kv-aware"]["prefix_hit_rate"] != rows["round-robin"]["prefix_hit_rate"]


def test_every_bundled_sweep_example_loads_and_resolves():
    """examples/sweep_*.toml as a user runs them: every grid point is a configuration kvsim resolves."""
    from pathlib import Path

    from kvsim.sim.run.config import resolve
    from kvsim.sim.studies.sweep import load_sweep

    examples = sorted((Path(__file__).resolve().parents[1] / "examples").glob("sweep_*.toml"))
    assert len(examples) >= 3
    for path in examples:
        base, grid = load_sweep(path)
        for _, _, config in expand_grid(base, grid):
            resolve(config)
