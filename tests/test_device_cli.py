"""``kvsim device``: the bundled list, and one device's figures after its base, as a user reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvsim.cli.main import main
from kvsim.sim.perf.device import bundled_devices, load_device


def test_the_list_names_every_bundled_device_with_its_platform() -> None:
    result = CliRunner().invoke(main, ["device", "list"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split()[1] for line in result.output.splitlines()}
    assert rows == {name: load_device(name).platform for name in bundled_devices()}
    assert "h200" in rows and rows["ascend-910c"] == "ascend"


def test_info_shows_a_what_if_device_beside_the_run_after_its_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fast-hbm.toml").write_text('base = "ascend-910b3"\nhbm_bandwidth = 3.2e12\n')
    monkeypatch.chdir(tmp_path)
    text = CliRunner().invoke(main, ["device", "info", "--device", "fast-hbm"])
    assert text.exit_code == 0, text.output
    assert text.output.splitlines()[0] == "fast-hbm (ascend 910b)"
    assert "64.00 GiB at 3.20 TB/s" in text.output and "block size 128, max_num_batched_tokens 2048" in text.output
    assert "Source: fast-hbm.toml over ascend-910b3.toml: " in text.output
    data = json.loads(CliRunner().invoke(main, ["device", "info", "--device", "fast-hbm", "--json"]).output)
    b3 = load_device("ascend-910b3")
    assert data["hbm_bandwidth"] == 3.2e12 and data["matrix_flops"] == b3.matrix_flops
    assert data["operators"]["gemm"]["compute_efficiency"] == b3.operators["gemm"].compute_efficiency
    assert data["vllm_defaults"] == {"block_size": 128, "block_size_mla": 128, "max_num_batched_tokens": 2048, "max_num_seqs": 256}


def test_info_gives_flashmlas_block_on_hopper_and_vllms_larger_budget() -> None:
    data = json.loads(CliRunner().invoke(main, ["device", "info", "--device", "h100-sxm", "--json"]).output)
    assert data["vllm_defaults"] == {"block_size": 16, "block_size_mla": 64, "max_num_batched_tokens": 8192, "max_num_seqs": 1024}
    assert (data["platform"], data["generation"]) == ("cuda", "hopper")


def test_info_shows_the_graph_capture_coefficients_where_a_device_has_them() -> None:
    h100 = CliRunner().invoke(main, ["device", "info", "--device", "h100-sxm"]).output
    assert "Graph capture: 171 KiB a layer and graph" in h100
    assert "Graph capture" not in CliRunner().invoke(main, ["device", "info", "--device", "ascend-910b3"]).output
    data = json.loads(CliRunner().invoke(main, ["device", "info", "--device", "h100-sxm", "--json"]).output)
    assert data["graph_memory"]["split_accumulators"] == pytest.approx(40.96)
