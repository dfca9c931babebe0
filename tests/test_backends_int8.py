"""int8 KV (C8) with static per-channel scales: quantisation, and the portable path as the reference.

The portable path dequantises the int8 blocks it gathers, so it must agree with dense attention
over the same dequantised K/V to fp32 rounding; what int8 costs against a float cache is measured
end to end (tests/test_end_to_end.py), not here.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvsim.realexec.backends.cpu import CpuBackend  # noqa: E402
from kvsim.realexec.backends.kv_quant import INT8_MAX, KVScales, dequantize, quantize  # noqa: E402
from kvsim.realexec.backends.paged_cases import PagedCase, load_case, random_case  # noqa: E402
from kvsim.realexec.model import kv_cache_dtypes  # noqa: E402

SCENARIOS = {
    "prefill": ([13, 40], [13, 40]),
    "chunked_prefill": ([24, 9], [170, 259]),
    "decode": ([1] * 8, [1, 5, 17, 33, 64, 100, 129, 300]),
    "mixed": ([30, 1, 1, 12, 1], [30, 90, 7, 140, 300]),
}


def test_quantise_round_trip_is_within_half_a_step_and_saturates() -> None:
    x = torch.randn(500, 2, 64, generator=torch.Generator().manual_seed(1))
    scales = KVScales.from_absmax(x.abs().amax(0), x.abs().amax(0))
    q = quantize(x, scales.key)
    assert q.dtype == torch.int8 and int(q.abs().max()) == INT8_MAX  # each channel's max maps to 127
    assert float(((dequantize(q, scales.key, torch.float32) - x).abs() / scales.key).max()) <= 0.5 + 1e-5
    assert torch.equal(quantize(x * 10, scales.key).abs().amax(0), torch.full((2, 64), INT8_MAX, dtype=torch.int8))


def test_a_channel_that_is_always_zero_gets_a_finite_scale() -> None:
    scales = KVScales.from_absmax(torch.zeros(2, 64), torch.ones(2, 64))
    assert bool((scales.key > 0).all())
    assert torch.equal(quantize(torch.zeros(3, 2, 64), scales.key), torch.zeros(3, 2, 64, dtype=torch.int8))


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size", [16, 128])
def test_portable_int8_attention_is_dense_attention_over_the_dequantised_cache(scenario, block_size) -> None:
    backend = CpuBackend()
    case = random_case(*SCENARIOS[scenario], num_heads=4, num_kv_heads=2, head_size=64, block_size=block_size,
                       dtype=torch.float32)
    scales = case.absmax_scales()
    key_cache, value_cache = load_case(backend, case, scales)
    assert key_cache.dtype == torch.int8
    out = backend.attention(case.query, key_cache, value_cache, case.meta, case.scale, scales)
    dequantised = PagedCase(
        case.query,
        dequantize(quantize(case.key, scales.key), scales.key, torch.float32),
        dequantize(quantize(case.value, scales.value), scales.value, torch.float32),
        case.meta,
        case.num_blocks,
        case.scale,
    )
    torch.testing.assert_close(out, dequantised.expected(), atol=2e-5, rtol=1e-5)
    # ... and it is an approximation of the float result, not something else
    assert float((out - case.expected()).abs().max()) < 0.05


def test_gather_copy_and_swap_move_int8_bytes_unchanged() -> None:
    backend = CpuBackend()
    case = random_case([3, 1], [3, 200], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
    scales = case.absmax_scales()
    key_cache, value_cache = load_case(backend, case, scales)
    key, _ = backend.gather_kv(key_cache, value_cache, case.meta.block_tables, case.meta.seq_lens)
    assert torch.equal(key, quantize(case.key, scales.key))
    caches = [(key_cache, value_cache)]
    host = backend.allocate_host_cache(1, case.num_blocks, 16, 2, 64, torch.int8)
    backend.swap(caches, host, [(b, b) for b in range(case.num_blocks)])
    assert torch.equal(host[0][0], key_cache) and host[0][0].dtype == torch.int8


def test_a_float_query_over_an_int8_cache_needs_scales() -> None:
    backend = CpuBackend()
    case = random_case([2], [2], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
    key_cache, value_cache = load_case(backend, case, case.absmax_scales())
    with pytest.raises(ValueError, match="needs its layer's KVScales"):
        backend.attention(case.query, key_cache, value_cache, case.meta, case.scale)


def test_an_int8_cache_attends_in_the_model_dtype_or_in_one_the_kernels_take() -> None:
    assert kv_cache_dtypes("int8", torch.float32) == (torch.int8, torch.float32)
    assert kv_cache_dtypes("int8", torch.float32, (torch.float16, torch.bfloat16)) == (torch.int8, torch.bfloat16)
    assert kv_cache_dtypes("int8", torch.float16, (torch.float16, torch.bfloat16)) == (torch.int8, torch.float16)
    assert kv_cache_dtypes("bf16", torch.float32) == (torch.bfloat16, torch.bfloat16)
