"""kvsim sweep: the grid expands, each configuration is its own run, sweep.csv holds them all."""

from __future__ import annotations

import csv

from click.testing import CliRunner

from kvsim.sim.cli import main
from kvsim.sim.run_config import RunConfig
from kvsim.sim.sweep import expand_grid


def test_grid_is_the_cartesian_product():
    configs = dict(expand_grid(RunConfig(), {"block_size": [16, 128], "kv_dtype": ["bf16", "int8"]}))
    assert sorted(configs) == ["block_size=128,kv_dtype=bf16", "block_size=128,kv_dtype=int8",
                               "block_size=16,kv_dtype=bf16", "block_size=16,kv_dtype=int8"]
    assert configs["block_size=16,kv_dtype=int8"].kv_dtype == "int8"
    assert configs["block_size=16,kv_dtype=int8"].block_size == 16


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
    for row in rows:
        assert (tmp_path / "out" / row["name"] / "summary.json").exists()
    # fewer tokens per block means more blocks in use at peak for the same traffic
    peak = {r["name"]: int(r["peak_kv_blocks_used"]) for r in rows}
    assert peak["block_size=16,kv_dtype=bf16"] > peak["block_size=32,kv_dtype=bf16"]


def test_sweep_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('trace = "demo"\n[grid]\nblock_sizes = [16]\n')
    result = CliRunner().invoke(main, ["sweep", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert "bad.toml" in result.output and "block_sizes" in result.output
