"""Bundled model specs and device profiles: published shapes, sources, strict loading, round trips."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvsim.sim.perf.device import (
    DEVICES_DIR,
    OPERATOR_KEYS,
    OperatorCoefficients,
    bundled_devices,
    load_device,
    save_device,
)
from kvsim.sim.perf.model_spec import MODELS_DIR, load_model

# Published parameter counts (model cards / HF "model size").
KNOWN_SIZES = {
    "llama-2-7b": (6.74e9, 2),
    "llama-3-8b": (8.03e9, 2),
    "qwen2.5-7b": (7.62e9, 2),
    "qwen3-8b": (8.19e9, 2),
    "llama-2-13b": (13.0e9, 1),
}


@pytest.mark.parametrize("name", sorted(KNOWN_SIZES))
def test_num_params_matches_published_size(name: str) -> None:
    size, digits = KNOWN_SIZES[name]
    assert round(load_model(name).num_params() / 1e9, digits) == round(size / 1e9, digits)


def test_attention_shapes_follow_the_configs() -> None:
    kv_heads = {name: load_model(name).num_kv_heads for name in KNOWN_SIZES}
    assert kv_heads == {"llama-2-7b": 32, "llama-3-8b": 8, "qwen2.5-7b": 4, "qwen3-8b": 8, "llama-2-13b": 40}
    for name in KNOWN_SIZES:
        spec = load_model(name)
        assert spec.head_dim == 128 and spec.num_heads * spec.head_dim == spec.hidden_size
        assert spec.weight_dtype in ("bf16", "fp16") and spec.kv_dtype == spec.weight_dtype
        assert spec.source.startswith("https://huggingface.co/")
    # Llama-2-7B fp16: 2 (K,V) x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token.
    assert load_model("llama-2-7b").kv_bytes_per_token() == 512 * 1024
    assert load_model("llama-3-8b").kv_bytes_per_token() == 128 * 1024


def test_qkv_bias_counts_only_where_the_model_has_it() -> None:
    qwen = load_model("qwen2.5-7b")
    assert qwen.qkv_bias and not load_model("llama-3-8b").qkv_bias
    no_bias = qwen.num_params() - qwen.num_layers * (qwen.q_size + 2 * qwen.kv_size)
    assert no_bias == 7_615_487_488


def test_model_loader_errors_name_file_and_field(tmp_path: Path) -> None:
    text = (MODELS_DIR / "tiny.toml").read_text()
    missing = tmp_path / "missing.toml"
    missing.write_text(text.replace("vocab_size = 4096\n", ""))
    with pytest.raises(ValueError, match=r"missing\.toml: missing field.*vocab_size"):
        load_model(missing)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(text.replace("num_layers = 4", 'num_layers = "4"'))
    with pytest.raises(ValueError, match=r"wrong\.toml: field num_layers must be int"):
        load_model(wrong)
    bad_heads = tmp_path / "heads.toml"
    bad_heads.write_text(text.replace("num_kv_heads = 2", "num_kv_heads = 3"))
    with pytest.raises(ValueError, match=r"heads\.toml: .*not a multiple"):
        load_model(bad_heads)
    with pytest.raises(ValueError, match="unknown model 'nope'.*llama-2-7b"):
        load_model("nope")


EXPECTED_DEVICES = {"ascend-910b1", "ascend-910b2", "ascend-910b3", "ascend-910b4", "ascend-910c", "a100-sxm", "h100-sxm",
                    "h100-pcie", "h200", "rtx-3090", "cpu"}


def test_bundled_devices_load_with_sane_figures() -> None:
    assert set(bundled_devices()) == EXPECTED_DEVICES
    for name in bundled_devices():
        dev = load_device(name)
        assert dev.name == name and dev.source
        assert set(dev.operators) == set(OPERATOR_KEYS)
        assert dev.matrix_flops["int8"] >= dev.matrix_flops["bf16"] >= dev.matrix_flops["fp32"] > 0
        for op, coeffs in dev.operators.items():
            assert coeffs.call_s >= 0
            for eff in (coeffs.compute_efficiency, coeffs.memory_efficiency, coeffs.w8a8_compute_efficiency):
                assert eff is None or 0 < eff <= 1, (name, op)
    b2, b3, b4 = (load_device(f"ascend-910b{i}") for i in (2, 3, 4))
    assert b2.matrix_flops["bf16"] > b3.matrix_flops["bf16"] > b4.matrix_flops["bf16"]
    assert b4.hbm_bytes == b2.hbm_bytes // 2 and b4.hbm_bandwidth < b2.hbm_bandwidth
    assert load_device("h200").hbm_bandwidth > load_device("h100-sxm").hbm_bandwidth > load_device("a100-sxm").hbm_bandwidth
    assert load_device("h100-sxm").matrix_flops["bf16"] > 3 * load_device("a100-sxm").matrix_flops["bf16"]


@pytest.mark.parametrize("sibling", ["h200", "h100-pcie", "a100-sxm"])
def test_the_other_gpus_carry_the_h100s_fitted_host_and_server_times(sibling: str) -> None:
    """Their files say their host and API-server times are the H100's fitted ones (same software and host, no row of
    theirs fits them): they read them from h100-sxm.toml (``base``), so a refit of the H100 reaches them, unless one of
    them writes a stale copy of its own."""
    h100, other = load_device("h100-sxm"), load_device(sibling)
    for field in ("request_s", "admit_s", "stream_s"):
        assert getattr(other.engine, field) == getattr(h100.engine, field), field
    assert other.operators["host_step"].call_s == h100.operators["host_step"].call_s


def test_the_h200_computes_as_the_h100_it_shares_a_die_with() -> None:
    """h200.toml takes the H100's fitted GEMM efficiency and its MoE table (the 8-bit share fitted there): the same die and
    the same vLLM. It once kept a lone-matmul microbenchmark's 0.80, which made serving on it 2.3x faster in compute
    than on the H100 that the serving rows were fitted on."""
    h100, h200 = load_device("h100-sxm"), load_device("h200")
    for op in ("gemm", "moe"):
        assert h200.operators[op] == h100.operators[op], op
    assert h200.matrix_flops == h100.matrix_flops


def test_the_h100_pcie_runs_the_sxm_parts_shares_at_its_own_datasheet_rates() -> None:
    """h100-pcie.toml: the same die and vLLM as the SXM part, so the SXM's operator table (its fitted shares among them),
    at the PCIe card's own peaks (0.76 of the SXM's compute, 2.0 of 3.35 TB/s) and a bridged pair's NVLink."""
    sxm, pcie = load_device("h100-sxm"), load_device("h100-pcie")
    assert pcie.operators == sxm.operators
    assert pcie.matrix_flops["bf16"] == pytest.approx(0.764 * sxm.matrix_flops["bf16"], rel=0.01)
    assert pcie.hbm_bandwidth == 2.0e12 and pcie.hbm_bytes == sxm.hbm_bytes
    assert pcie.topology.devices_per_node == 2 and pcie.topology.inter_bandwidth < pcie.topology.intra_bandwidth


@pytest.mark.parametrize("sibling", ["ascend-910b1", "ascend-910b2", "ascend-910b4", "ascend-910c"])
def test_the_other_ascend_parts_run_the_910b3s_software_on_their_own_hardware(sibling: str) -> None:
    """The same vllm-ascend on every part: the engine and every operator share (the terms fitted on 910B3 rows among
    them) are read from the 910B3's file, so a refit reaches them (they once held an older fit's engine times, and
    estimates where the 910B3 had fits, which made an A2 / A3 comparison price their MoE layers differently); their
    memory, peaks and links stay their own."""
    b3, other = load_device("ascend-910b3"), load_device(sibling)
    assert other.operators == b3.operators
    assert other.engine == replace(b3.engine, source=other.engine.source)
    assert other.platform == "ascend" and other.matrix_flops != b3.matrix_flops


CONFIDENCE_WORDS = ("high", "medium", "low", "estimate", "fitted")


def figure_comment_problems(text: str) -> list[str]:
    """Figures (top-level numbers and [matrix_flops] rates) whose comment block above names no
    ``source:`` or no ``confidence:`` word."""
    lines = text.splitlines()
    section, problems = "", []
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line.strip()
            continue
        identity = line.startswith(("base", "name", "source", "platform", "generation"))  # not figures
        if "=" not in line or line.startswith("#") or identity or section not in ("", "[matrix_flops]"):
            continue
        j = i - 1
        while j >= 0 and lines[j].startswith("#"):
            j -= 1
        block = " ".join(lines[j + 1 : i]).lower()
        has_confidence = any(f"confidence: {w}" in block for w in CONFIDENCE_WORDS)
        if "source:" not in block or not has_confidence:
            problems.append(line.split("=")[0].strip())
    return problems


@pytest.mark.parametrize("path", sorted(DEVICES_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_figure_cites_a_source_and_a_confidence(path: Path) -> None:
    assert figure_comment_problems(path.read_text()) == [], path.name


def test_a_figure_without_a_source_fails_the_check() -> None:
    cited = "# source: a datasheet; confidence: high\nhbm_bandwidth = 1e12\n"
    assert figure_comment_problems(cited) == []
    assert figure_comment_problems("# 1 TB/s\nhbm_bandwidth = 1e12\n") == ["hbm_bandwidth"]
    assert figure_comment_problems("# source: a datasheet\nhbm_bandwidth = 1e12\n") == ["hbm_bandwidth"]
    assert figure_comment_problems("[matrix_flops]\nfp16 = 1e14\n") == ["fp16"]


# An absolute path into a machine's file system (a build host's checkout, a home directory).
MACHINE_PATH = re.compile(r"(?:^|[\s\"'(=])/(?:home|root|Users|work|tmp|opt|mnt|data)/", re.MULTILINE)


def test_the_machine_path_pattern_catches_what_it_is_for() -> None:
    assert MACHINE_PATH.search('source = "' + "/" + "home/someone/specs.pdf" + '"')
    assert MACHINE_PATH.search("# read from " + "/" + "work/main/notes.md")
    assert MACHINE_PATH.search("# see https://example.org/home/x and docs/work/y") is None


@pytest.mark.parametrize("path", sorted(DEVICES_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_no_device_file_cites_a_machine_path(path: Path) -> None:
    assert MACHINE_PATH.search(path.read_text()) is None, path.name


@pytest.mark.parametrize("name", sorted(EXPECTED_DEVICES))
def test_save_device_round_trips(name: str, tmp_path: Path) -> None:
    dev = load_device(name)
    assert load_device(save_device(dev, tmp_path / f"{name}.toml")) == dev
    calibrated = dev.with_operators(
        {"gemm": OperatorCoefficients(call_s=1.234567891e-6, compute_efficiency=0.6180339887, memory_efficiency=0.91)},
        source="calibrated in a test",
    )
    again = load_device(save_device(calibrated, tmp_path / "calibrated.toml"))
    assert again == calibrated and again != dev
    assert again.operators["gemm"].call_s == 1.234567891e-6
    assert dev.step_timing_noise is None  # only profiles measured by kvsim profile carry it
    measured = replace(calibrated, step_timing_noise=0.1372)
    assert load_device(save_device(measured, tmp_path / "measured.toml")) == measured


def test_launch_s_defaults_to_the_device_launch_overhead(tmp_path: Path) -> None:
    text = (DEVICES_DIR / "ascend-910b3.toml").read_text()
    dev = load_device(DEVICES_DIR / "ascend-910b3.toml")
    assert dev.operators["gemm"].call_s == dev.launch_overhead_s
    custom = tmp_path / "custom.toml"
    custom.write_text(text.replace("[operators.gemm]\n", "[operators.gemm]\nlaunch_s = 7e-6\n"))
    assert load_device(custom).operators["gemm"].call_s == 7e-6
    assert load_device(custom).operators["attn_decode"].call_s == dev.launch_overhead_s


def test_device_found_by_name_in_a_search_dir(tmp_path: Path) -> None:
    text = (DEVICES_DIR / "cpu.toml").read_text().replace('name = "cpu"', 'name = "mybox"')
    (tmp_path / "mybox.toml").write_text(text)
    assert load_device("mybox", search_dirs=[tmp_path]).name == "mybox"
    with pytest.raises(ValueError, match="unknown device 'mybox'.*ascend-910b3"):
        load_device("mybox")


def test_a_device_file_starts_from_its_base_and_replaces_only_what_it_names(tmp_path: Path) -> None:
    """A what-if part in three lines: the 910B3 with twice its HBM bandwidth and another GEMM share; tables merge key
    by key (the GEMM's memory share stays the base's; the MoE table, which names no share, follows the new GEMM one as
    it follows the base's) and the name is the file's, never the base's."""
    (tmp_path / "fast-hbm.toml").write_text(
        'base = "ascend-910b3"\nhbm_bandwidth = 3.2e12\n[operators.gemm]\ncompute_efficiency = 0.9\n')
    b3, fast = load_device("ascend-910b3"), load_device("fast-hbm", search_dirs=[tmp_path])
    assert fast.name == "fast-hbm" and fast.hbm_bandwidth == 3.2e12
    assert fast.operators["gemm"] == replace(b3.operators["gemm"], compute_efficiency=0.9)
    assert fast.operators["moe"] == replace(b3.operators["moe"], compute_efficiency=0.9)
    assert fast.source == f"fast-hbm.toml over ascend-910b3.toml: {b3.source}"
    as_base = replace(fast, name=b3.name, source=b3.source, hbm_bandwidth=b3.hbm_bandwidth,
                      operators={**fast.operators, "gemm": b3.operators["gemm"], "moe": b3.operators["moe"]})
    assert as_base == b3


def test_a_base_chain_resolves_beside_the_file_and_a_local_file_may_shadow_its_bundled_base(tmp_path: Path) -> None:
    (tmp_path / "h100-sxm.toml").write_text('base = "h100-sxm"\nhbm_bandwidth = 3.0e12\n')  # the bundled one, not itself
    (tmp_path / "mine.toml").write_text('base = "h100-sxm"\nname = "my-h100"\n[topology]\ndevices_per_node = 4\n')
    mine, bundled = load_device(tmp_path / "mine.toml"), load_device("h100-sxm")
    assert mine.name == "my-h100" and mine.hbm_bandwidth == 3.0e12 and mine.topology.devices_per_node == 4
    assert mine.topology == replace(bundled.topology, devices_per_node=4)
    assert mine.matrix_flops == bundled.matrix_flops and mine.engine == bundled.engine


@pytest.mark.parametrize(
    "files, message",
    [
        ({"a.toml": 'base = "b"\n', "b.toml": 'base = "a.toml"\n'}, r"b\.toml: field base makes a cycle \(a\.toml -> b\.toml -> a\.toml\)"),
        ({"a.toml": 'base = "no-such-part"\n'}, r"a\.toml: field base names unknown device 'no-such-part'; bundled: .*h100-sxm"),
        ({"a.toml": 'base = "sub/b.toml"\n'}, r"a\.toml: field base 'sub/b\.toml': no such file"),
        ({"a.toml": "base = 3\n"}, r"a\.toml: field base must be a device name or a \.toml path, got 3"),
        ({"a.toml": 'base = "h200"\nhbm_bandwith = 1e12\n'}, r"a\.toml: unknown field\(s\) hbm_bandwith"),
    ],
)
def test_a_bad_base_is_named_with_the_file(files: dict[str, str], message: str, tmp_path: Path) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        load_device(tmp_path / "a.toml")


@pytest.mark.parametrize(
    "edit, message",
    [
        (("hbm_bandwidth = 1.6e12\n", ""), r"missing field hbm_bandwidth"),
        (("hbm_bytes = 68719476736", "hbm_bytes = 64.0"), r"field hbm_bytes must be an integer"),
        (("hbm_bandwidth = 1.6e12", "hbm_bandwidth = 0"), r"field hbm_bandwidth must be > 0"),
        (("hbm_bandwidth = 1.6e12", "hbm_bandwith = 1.6e12"), r"unknown field\(s\) hbm_bandwith"),
        (("int8 = 6.26e+14\n", ""), r"missing field matrix_flops\.int8"),
        (("[operators.swap]\nmemory_efficiency = 0.80\n", ""), r"missing table \[operators\.swap\]"),
        (("[operators.kv_write]\n", "[operators.kv_write]\ncompute_efficiency = 0.5\n"),
         r"unknown field\(s\) operators\.kv_write\.compute_efficiency"),
        (("block_s = 2e-8", "block_s = -1.0"), r"field operators\.paged_gather\.block_s must be >= 0"),
        (("[operators.swap]", "[operators.swapp]"), r"unknown field\(s\) operators\.swapp"),
        (('platform = "ascend"', 'platform = "npu"'), r"field platform must be one of ascend, cuda, cpu, got 'npu'"),
        (('platform = "ascend"\n', ""), r"field platform must be one of ascend, cuda, cpu, got None"),
        (('generation = "910b"', 'generation = "hopper"'),
         r"field generation 'hopper' is not one kvsim knows on platform ascend \(known: 910b, 910c\)"),
    ],
)
def test_device_loader_errors_name_file_and_field(edit: tuple[str, str], message: str, tmp_path: Path) -> None:
    text = (DEVICES_DIR / "ascend-910b3.toml").read_text()
    assert edit[0] in text
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(ValueError, match=r"bad\.toml: " + message):
        load_device(bad)


def test_invalid_toml_is_reported_with_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.toml"
    bad.write_text("hbm_bytes = = 3\n")
    with pytest.raises(ValueError, match=r"broken\.toml: invalid TOML"):
        load_device(bad)
