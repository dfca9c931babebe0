"""The npu backend on the strict torch_npu stand-in: the ops it picks, the arguments it passes, the results.

The stand-in computes with the dense reference, so agreement here checks what the backend controls:
which op runs, and the layouts, lengths, tables and masks it hands over, against each op's contract.
"""

from __future__ import annotations

import re
import sys

import pytest

torch = pytest.importorskip("torch")

from torch_npu_standin import ContractViolation, make_torch_npu_standin  # noqa: E402

from kvsim.realexec.backends import BackendUnavailable, get_backend  # noqa: E402
from kvsim.realexec.backends.cpu import CpuBackend  # noqa: E402
from kvsim.realexec.backends.npu import NpuBackend, import_torch_npu  # noqa: E402
from kvsim.realexec.backends.npu_preflight import PreflightWarning  # noqa: E402
from kvsim.realexec.backends.paged_cases import load_case, random_case  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::kvsim.realexec.backends.npu_preflight.PreflightWarning")

SCENARIOS = {
    "prefill": ([13, 40], [13, 40]),
    "chunked_prefill": ([24, 9], [170, 259]),
    "decode": ([1] * 8, [1, 5, 17, 33, 64, 100, 129, 300]),
    "mixed": ([30, 1, 1, 12, 1], [30, 90, 7, 140, 300]),
}


@pytest.fixture
def standin():
    return make_torch_npu_standin()


@pytest.fixture
def backend(standin):
    return NpuBackend("cpu", torch_npu_module=standin)


def run_case(
    backend,
    standin,
    query_lens,
    seq_lens,
    *,
    block_size=128,
    dtype=torch.bfloat16,
    num_heads=4,
    num_kv_heads=2,
    head_size=64,
    slot_dtype=torch.int32,
):
    case = random_case(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        slot_dtype=slot_dtype,
    )
    key_cache, value_cache = load_case(backend, case)
    standin.calls.clear()
    out = backend.attention(case.query, key_cache, value_cache, case.meta, case.scale)
    torch.testing.assert_close(out, case.expected(), atol=1e-6, rtol=0)
    return list(standin.calls)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_attention_matches_reference_through_the_documented_ops(backend, standin, scenario, dtype) -> None:
    calls = run_case(backend, standin, *SCENARIOS[scenario], dtype=dtype)
    expected_op = "_npu_paged_attention" if scenario == "decode" else "npu_fused_infer_attention_score"
    assert calls == [expected_op]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 4, 64), (8, 1, 128), (16, 2, 128)])
def test_grouped_query_heads(backend, standin, num_heads, num_kv_heads, head_size) -> None:
    for scenario in ("mixed", "decode"):
        run_case(
            backend, standin, *SCENARIOS[scenario], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size
        )


def test_decode_with_blocks_larger_than_paged_attention_takes_goes_through_fia(backend, standin) -> None:
    assert run_case(backend, standin, *SCENARIOS["decode"], block_size=256) == ["npu_fused_infer_attention_score"]


def test_writes_use_scatter_in_norm_mode_with_int32_slots(backend, standin) -> None:
    """Metadata may carry int64 slots; the op is still given int32, and the ND cache mode."""
    run_case(backend, standin, *SCENARIOS["mixed"], slot_dtype=torch.int64)
    key_cache, value_cache = backend.allocate_kv_cache(1, 2, 128, 2, 64, torch.float16)[0]
    standin.calls.clear()
    backend.write_kv(
        torch.ones(3, 2, 64, dtype=torch.float16),
        torch.ones(3, 2, 64, dtype=torch.float16),
        key_cache,
        value_cache,
        torch.tensor([5, 130, 7]),
    )
    assert standin.calls == ["npu_scatter_pa_kv_cache"]
    assert key_cache.view(-1, 2, 64)[[5, 130, 7]].eq(1).all() and int(key_cache.count_nonzero()) == 3 * 2 * 64


def test_versions_without_scatter_or_gather_fall_back_to_atb_ops(standin) -> None:
    del standin.npu_scatter_pa_kv_cache
    del standin.npu_gather_pa_kv_cache
    backend = NpuBackend("cpu", torch_npu_module=standin)
    assert (backend.write_op, backend.gather_op) == ("_npu_reshape_and_cache", "atb.npu_paged_cache_load")
    case = random_case([4, 1], [4, 150], num_heads=4, num_kv_heads=2, head_size=64, block_size=128, dtype=torch.float16)
    key_cache, value_cache = load_case(backend, case)
    key, value = backend.gather_kv(key_cache, value_cache, case.meta.block_tables, case.meta.seq_lens)
    assert torch.equal(key, case.key) and torch.equal(value, case.value)
    assert set(standin.calls) == {"_npu_reshape_and_cache", "atb.npu_paged_cache_load"}


def test_gather_kv_uses_the_gather_op(backend, standin) -> None:
    case = random_case(
        [3, 1], [3, 200], num_heads=4, num_kv_heads=2, head_size=64, block_size=128, dtype=torch.bfloat16
    )
    key_cache, value_cache = load_case(backend, case)
    standin.calls.clear()
    key, value = backend.gather_kv(key_cache, value_cache, case.meta.block_tables, case.meta.seq_lens.long())
    assert standin.calls == ["npu_gather_pa_kv_cache"]
    assert torch.equal(key, case.key) and torch.equal(value, case.value)


@pytest.mark.parametrize("block_size", [16, 64, 640])
def test_block_sizes_fia_cannot_prefill_with_are_refused_at_allocation(backend, block_size) -> None:
    with pytest.raises(ValueError, match="multiple of 128 in \\[128, 512\\]"):
        backend.allocate_kv_cache(1, 4, block_size, 2, 64, torch.float16)


def test_block_size_16_is_what_the_stand_in_would_reject_in_prefill(standin) -> None:
    """The allocation check mirrors the op: FIA itself refuses a 16-token block for a multi-token query."""
    backend = NpuBackend("cpu", torch_npu_module=standin)
    case = random_case(
        [5], [5], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float16, slot_dtype=torch.int32
    )
    key_cache = torch.zeros(case.num_blocks, 16, 2, 64, dtype=torch.float16)
    value_cache = torch.zeros_like(key_cache)
    backend.write_kv(case.key, case.value, key_cache, value_cache, case.meta.slot_mapping)
    with pytest.raises(ContractViolation) as err:
        backend.attention(case.query, key_cache, value_cache, case.meta, case.scale)
    assert err.value.rule.id == "fia.pfa_block_size"


def test_fp32_caches_are_refused(backend) -> None:
    with pytest.raises(ValueError, match="float16/bfloat16"):
        backend.allocate_kv_cache(1, 4, 128, 2, 64, torch.float32)


def test_copy_and_swap_blocks(backend) -> None:
    device = backend.allocate_kv_cache(1, 4, 128, 2, 64, torch.float16)
    host = backend.allocate_host_cache(1, 4, 128, 2, 64, torch.float16)
    assert not host[0][0].is_pinned()  # nothing to pin for on a host standing in for the NPU
    device[0][0][1].fill_(3)
    backend.copy_blocks(device, [(1, 2)])
    backend.swap(device, host, [(2, 0)])
    assert host[0][0][0].eq(3).all() and device[0][0][2].eq(3).all()


def test_synchronize_timing_and_memory_go_through_torch_npu(backend, standin, monkeypatch) -> None:
    backend.synchronize()
    assert standin.calls == ["npu.synchronize"]
    result, seconds = backend.elapsed(lambda: sum(range(1000)))
    assert result == 499500 and 0 <= seconds < 1
    monkeypatch.setattr(standin.npu, "memory_allocated", lambda device=None: 12345 if device == backend.device else -1)
    assert backend.memory_in_use() == 12345


def test_factory_uses_an_injected_torch_npu(monkeypatch, standin) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", standin)
    backend = get_backend("npu", "cpu")
    assert isinstance(backend, NpuBackend) and backend.torch_npu is standin


def test_missing_torch_npu_is_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ModuleNotFoundError
    with pytest.raises(BackendUnavailable) as err:
        import_torch_npu()
    assert str(err.value).startswith("npu backend unavailable: torch_npu is not installed (pip install torch-npu==")
    assert "\n" not in str(err.value)


def test_torch_npu_without_cann_is_one_line(monkeypatch, tmp_path) -> None:
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        "raise OSError('libhccl.so: cannot open shared object file: No such file or directory\\nmore detail')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(BackendUnavailable) as err:
        get_backend("npu")
    message = str(err.value)
    assert message.startswith(
        "npu backend unavailable: torch_npu failed to import (libhccl.so: cannot open shared object file"
    )
    assert "set_env.sh" in message and "\n" not in message


def test_no_visible_device_is_one_line(standin, monkeypatch) -> None:
    monkeypatch.setattr(standin.npu, "is_available", lambda: False)
    with pytest.raises(
        BackendUnavailable, match="^npu backend unavailable: torch_npu imported but sees no NPU device$"
    ):
        NpuBackend("cpu", torch_npu_module=standin)


# -- preflight: one message per problem, each naming its fix ---------------------------------------------


def _preflight_error(standin) -> str:
    with pytest.raises(BackendUnavailable) as err:
        NpuBackend("cpu", torch_npu_module=standin)
    return str(err.value)


def test_preflight_passes_on_a_matching_environment(standin) -> None:
    assert NpuBackend("cpu", torch_npu_module=standin).preflight_warnings == []


def test_preflight_torch_npu_built_for_another_torch(standin) -> None:
    major, minor = torch.__version__.split(".")[:2]
    standin.__version__ = f"{major}.{int(minor) - 1}.0.post4"  # the release before the installed torch's
    message = _preflight_error(standin)
    assert f"torch_npu {standin.__version__}" in message
    assert f"pip install torch-npu=={torch.__version__.split('+')[0]}" in message


def test_preflight_cann_too_old_for_tnd_with_a_block_table(standin, monkeypatch) -> None:
    monkeypatch.setattr(standin.npu, "get_cann_version", lambda module="CANN": "8.2.RC1")
    message = _preflight_error(standin)
    assert "CANN 8.2.RC1 is older than 8.3" in message and "input_layout='TND'" in message


def test_preflight_unknown_cann_version_is_a_warning(standin, monkeypatch) -> None:
    def broken(module="CANN"):
        raise RuntimeError("no runtime")

    monkeypatch.setattr(standin.npu, "get_cann_version", broken)
    with pytest.warns(PreflightWarning, match="CANN version unknown"):
        NpuBackend("cpu", torch_npu_module=standin)


def test_preflight_loads_atb_eagerly_and_names_nnal(standin, monkeypatch) -> None:
    """torch_npu keeps libatb.so's load error until the first ATB call; the preflight makes that call at start."""

    def missing_nnal():
        raise OSError(
            "Please check that the nnal package is installed. Please run 'source set_env.sh' in the NNAL installation path."
        )

    monkeypatch.setattr(standin.op_plugin.atb._atb_ops, "_register_atb_extensions", missing_nnal)
    message = _preflight_error(standin)
    assert "ATB ops unavailable (Please check that the nnal package is installed." in message
    assert "/usr/local/Ascend/nnal/atb/set_env.sh" in message


def test_preflight_missing_op(standin) -> None:
    del standin._npu_paged_attention
    assert "has no _npu_paged_attention" in _preflight_error(standin)


def test_preflight_warns_when_graph_mode_cannot_run(standin) -> None:
    """Eager steps still run without the graph API; the warning says what is missing and how to run without it."""
    del standin.npu.graph_task_update_begin
    del standin._npu_fused_infer_attention_score_get_max_workspace
    with pytest.warns(PreflightWarning, match="graph mode"):
        warnings = NpuBackend("cpu", torch_npu_module=standin).preflight_warnings
    assert len(warnings) == 1 and "torch.npu.graph_task_update_begin, torch_npu._npu_fused_infer_attention_score_" \
        "get_max_workspace" in warnings[0] and "--enforce-eager" in warnings[0]


def test_preflight_reports_every_problem_at_once(standin, monkeypatch) -> None:
    standin.__version__ = "2.5.1"
    monkeypatch.setattr(standin.npu, "get_cann_version", lambda module="CANN": "8.0.0")
    message = _preflight_error(standin)
    assert isinstance(message, str) and message.count("\n  - ") == 2


@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_size,expected",
    [
        (torch.float32, 128, 2, 64, "KV dtype torch.float32 unsupported"),
        (torch.bfloat16, 64, 2, 64, "block_size=64 unsupported"),
        (torch.bfloat16, 128, 2, 72, "head_size=72 unsupported: FIA needs D <= 512, 16-aligned"),
        (torch.int8, 128, 2, 80, "head_size=80 unsupported: FIA needs D <= 512, 32-aligned"),
        (torch.bfloat16, 128, 2, 576, "head_size=576 unsupported"),
        (torch.bfloat16, 128, 256, 512, "exceeds 65535"),
    ],
)
def test_preflight_cache_limits(backend, dtype, block_size, num_kv_heads, head_size, expected) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        backend.allocate_kv_cache(1, 2, block_size, num_kv_heads, head_size, dtype)


def test_preflight_warns_for_fp16_and_for_head_sizes_paged_attention_cannot_take(backend, standin) -> None:
    with pytest.warns(PreflightWarning, match="fp16 through FIA's TND layout is unverified"):
        backend.allocate_kv_cache(1, 2, 128, 2, 64, torch.float16)
    with pytest.warns(PreflightWarning, match="beyond ATB PagedAttention's"):
        backend.allocate_kv_cache(1, 2, 128, 1, 320, torch.bfloat16)
    # ... and decode with such a head size goes through FIA, which takes D <= 512
    assert run_case(backend, standin, [1, 1], [5, 130], head_size=320, num_kv_heads=1) == [
        "npu_fused_infer_attention_score"
    ]


# -- int8 KV (C8) ------------------------------------------------------------------------------------


def _int8_case(backend, query_lens, seq_lens):
    case = random_case(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=128, dtype=torch.bfloat16,
        slot_dtype=torch.int32,
    )
    scales = case.absmax_scales()
    return case, scales, load_case(backend, case, scales), load_case(CpuBackend(), case, scales)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_int8_cache_matches_the_portable_reference(backend, standin, scenario) -> None:
    """Same int8 bytes as the cpu backend writes, and attention within bf16 rounding of the portable C8 path."""
    case, scales, (key_cache, value_cache), (ref_k, ref_v) = _int8_case(backend, *SCENARIOS[scenario])
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    standin.calls.clear()
    out = backend.attention(case.query, key_cache, value_cache, case.meta, case.scale, scales)
    # a mixed batch: its decodes on the int8 cache, its prefills over their blocks dequantised
    assert standin.calls == ["npu_fused_infer_attention_score"] * (2 if scenario == "mixed" else 1)
    expected = CpuBackend().attention(case.query.float(), ref_k, ref_v, case.meta, case.scale, scales)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)


def test_int8_cache_without_scales_is_refused(backend) -> None:
    key_cache, value_cache = backend.allocate_kv_cache(1, 2, 128, 2, 64, torch.int8)[0]
    with pytest.raises(ValueError, match="needs its layer's KVScales"):
        backend.write_kv(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), key_cache, value_cache, torch.tensor([0]))


def test_padding_slots_reach_the_write_kernel_and_are_skipped(backend, standin) -> None:
    key_cache, value_cache = backend.allocate_kv_cache(1, 2, 128, 2, 64, torch.bfloat16)[0]
    ones = torch.ones(3, 2, 64, dtype=torch.bfloat16)
    backend.write_kv(ones, ones, key_cache, value_cache, torch.tensor([5, -1, 7]))
    assert int(key_cache.count_nonzero()) == 2 * 2 * 64


def test_preflight_without_an_atb_module_says_so(standin) -> None:
    del standin.op_plugin
    assert "ATB ops unavailable (this torch_npu has no op_plugin.atb module)" in _preflight_error(standin)
