"""``kvsim doctor`` on the cpu backend and on the npu backend through the strict torch_npu stand-in."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402
from torch_npu_standin import make_torch_npu_standin  # noqa: E402

from kvsim.realexec.doctor import doctor  # noqa: E402

CHECKS = ("cache write + gather", "prefill", "chunked prefill (block table)", "paged decode", "mixed batch",
          "block copy", "swap out + in")


def run(*args: str):
    return CliRunner().invoke(doctor, list(args))


def rows(output: str) -> dict[str, str]:
    return {line[:30].strip(): line for line in output.splitlines() if line[:30].strip() in CHECKS}


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_doctor_passes_on_cpu(kv_dtype) -> None:
    result = run("--kv-cache-dtype", kv_dtype)
    assert result.exit_code == 0, result.output
    assert set(rows(result.output)) == set(CHECKS) and "7/7 checks passed" in result.output


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_doctor_passes_on_the_npu_standin(monkeypatch, kv_dtype) -> None:
    standin = make_torch_npu_standin()
    monkeypatch.setitem(sys.modules, "torch_npu", standin)
    result = run("--backend", "npu", "--device", "cpu", "--kv-cache-dtype", kv_dtype)
    assert result.exit_code == 0, result.output
    assert f"torch_npu {standin.__version__}" in result.output and "block 128" in result.output
    assert all(row.endswith("pass") for row in rows(result.output).values())
    expected_ops = {"npu_scatter_pa_kv_cache", "npu_gather_pa_kv_cache", "npu_fused_infer_attention_score"}
    if kv_dtype == "bf16":
        expected_ops.add("_npu_paged_attention")  # decode with 128-token blocks
    assert expected_ops <= set(standin.calls)


def test_doctor_fails_and_names_the_broken_kernel(monkeypatch) -> None:
    standin = make_torch_npu_standin()
    real_decode = standin._npu_paged_attention

    def off_by_a_bit(**kwargs):
        real_decode(**kwargs)
        kwargs["out"].add_(0.5)

    standin._npu_paged_attention = off_by_a_bit
    monkeypatch.setitem(sys.modules, "torch_npu", standin)
    result = run("--backend", "npu", "--device", "cpu")
    assert result.exit_code == 1
    table = rows(result.output)
    assert table["paged decode"].endswith("FAIL") and table["prefill"].endswith("pass")


def test_doctor_reports_a_kernel_that_raises_as_a_failed_check(monkeypatch) -> None:
    standin = make_torch_npu_standin()
    monkeypatch.setitem(sys.modules, "torch_npu", standin)
    result = run("--backend", "npu", "--device", "cpu", "--kv-cache-dtype", "int8", "--block-size", "256")
    assert result.exit_code == 0, result.output  # 256 is a size FIA takes
    del standin.npu_gather_pa_kv_cache  # gather then falls back to atb.npu_paged_cache_load ...
    standin.atb.npu_paged_cache_load = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("aclnn error 561103\nmore"))
    result = run("--backend", "npu", "--device", "cpu")
    assert result.exit_code == 1
    assert "RuntimeError: aclnn error 561103" in rows(result.output)["cache write + gather"]


def test_doctor_on_a_missing_backend_is_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    result = run("--backend", "npu")
    assert result.exit_code == 2 and "torch_npu is not installed" in result.output
