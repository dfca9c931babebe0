"""``kvsim doctor``: every kernel a backend uses, on tiny shapes, against the CPU reference.

The first command to run on a new machine: before a trace, a profile or a validation, it shows
whether each paged-KV kernel the backend calls (cache write, gather, prefill, chunked prefill
over a block table, decode, a mixed batch, block copy, swap) computes what the dense float64
reference computes, with the largest error beside the tolerance it is held to. A kernel that
raises is a failed check with its error's first line, not a crash, so one broken op does not
hide the state of the others. Exit status 0 only when every check passes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import click
import torch

from kvsim.realexec.backends import BACKEND_NAMES, BackendUnavailable, KernelBackend, get_backend
from kvsim.realexec.backends.kv_quant import KVScales, dequantize, quantize
from kvsim.realexec.backends.paged_cases import PagedCase, load_case, random_case
from kvsim.realexec.weights import torch_dtype

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64  # GQA 2:1, a head size every kernel takes
# Largest attention error allowed against the float64 reference, by the dtype attention runs in
# (a few units in the last place of outputs of magnitude ~1).
TOLERANCES = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (query lengths, sequence lengths): each attention scenario the executor produces.
SCENARIOS = {
    "prefill": ([13, 40], [13, 40]),
    "chunked prefill (block table)": ([24, 9], [170, 259]),
    "paged decode": ([1] * 6, [1, 17, 64, 129, 200, 300]),
    "mixed batch": ([30, 1, 12, 1], [30, 90, 140, 300]),
}


@dataclass(frozen=True)
class CheckResult:
    name: str
    max_error: float | None  # None when the kernel raised
    tolerance: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.max_error is not None and self.max_error <= self.tolerance


@dataclass(frozen=True)
class DoctorSetup:
    """The shapes and dtypes every check uses."""

    backend: KernelBackend
    kv_dtype: torch.dtype  # what the cache stores (int8 for C8)
    dtype: torch.dtype  # what queries, K/V and attention outputs are in
    block_size: int

    @property
    def int8(self) -> bool:
        return self.kv_dtype == torch.int8

    def case(self, query_lens: list[int], seq_lens: list[int], seed: int = 0) -> PagedCase:
        return random_case(query_lens, seq_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                           block_size=self.block_size, dtype=self.dtype, device=self.backend.device, seed=seed,
                           slot_dtype=torch.int32)

    def load(self, case: PagedCase) -> tuple[tuple[torch.Tensor, torch.Tensor], KVScales | None]:
        scales = case.absmax_scales().to(self.backend.device) if self.int8 else None
        return load_case(self.backend, case, scales), scales

    def stored(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """What a cache holds for ``x``: ``x`` itself, or its int8 quantisation."""
        return x if scale is None else quantize(x, scale)


def run_checks(setup: DoctorSetup) -> list[CheckResult]:
    """Every check, in the order a step uses the kernels."""
    checks: list[tuple[str, Callable[[DoctorSetup], float], float]] = [
        ("cache write + gather", _check_write_and_gather, 0.0)
    ]
    tolerance = TOLERANCES[setup.dtype]
    for name, (query_lens, seq_lens) in SCENARIOS.items():
        checks.append((name, _attention_check(query_lens, seq_lens), tolerance))
    checks += [("block copy", _check_copy, 0.0), ("swap out + in", _check_swap, 0.0)]
    results = []
    for name, check, tol in checks:
        try:
            results.append(CheckResult(name, check(setup), tol))
        except Exception as err:  # a kernel that rejects its inputs is a failed check, reported in one line
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            results.append(CheckResult(name, None, tol, f"{type(err).__name__}: {first_line}"))
    return results


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.cpu().double() - expected.cpu().double()).abs().max())


def _check_write_and_gather(setup: DoctorSetup) -> float:
    case = setup.case([1, 1, 1], [5, 130, 260], seed=1)
    (key_cache, value_cache), scales = setup.load(case)
    key, value = setup.backend.gather_kv(key_cache, value_cache, case.meta.block_tables, case.meta.seq_lens)
    expected_key = setup.stored(case.key, None if scales is None else scales.key)
    expected_value = setup.stored(case.value, None if scales is None else scales.value)
    return max(_max_error(key, expected_key), _max_error(value, expected_value))


def _attention_check(query_lens: list[int], seq_lens: list[int]) -> Callable[[DoctorSetup], float]:
    def check(setup: DoctorSetup) -> float:
        case = setup.case(query_lens, seq_lens, seed=2)
        (key_cache, value_cache), scales = setup.load(case)
        out = setup.backend.attention(case.query, key_cache, value_cache, case.meta, case.scale, scales)
        setup.backend.synchronize()
        if scales is not None:  # the reference attends over exactly what the int8 cache holds
            key = dequantize(quantize(case.key, scales.key), scales.key, case.key.dtype)
            value = dequantize(quantize(case.value, scales.value), scales.value, case.value.dtype)
            case = PagedCase(case.query, key, value, case.meta, case.num_blocks, case.scale)
        return _max_error(out, case.expected())

    return check


def _check_copy(setup: DoctorSetup) -> float:
    case = setup.case([1, 1], [40, 200], seed=3)
    (key_cache, value_cache), _ = setup.load(case)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    pairs = [(0, case.num_blocks - 1), (1, case.num_blocks - 2)]
    setup.backend.copy_blocks([(key_cache, value_cache)], pairs)
    setup.backend.synchronize()
    return max(_max_error(after[dst], before[src]) for src, dst in pairs for after, before in
               ((key_cache, before_k), (value_cache, before_v)))


def _check_swap(setup: DoctorSetup) -> float:
    case = setup.case([1, 1], [40, 200], seed=4)
    layer, _ = setup.load(case)
    caches = [layer]
    before = [t.clone() for t in layer]
    host = setup.backend.allocate_host_cache(1, case.num_blocks, setup.block_size, NUM_KV_HEADS, HEAD_SIZE,
                                             setup.kv_dtype)
    out_pairs = [(b, case.num_blocks - 1 - b) for b in range(case.num_blocks)]  # reversed: every block moves
    setup.backend.swap(caches, host, out_pairs)
    for t in caches[0]:
        t.zero_()
    setup.backend.swap(host, caches, [(h, d) for d, h in out_pairs])
    setup.backend.synchronize()
    return max(_max_error(after, b) for after, b in zip(caches[0], before))


def format_results(results: list[CheckResult]) -> str:
    rows = [f"{'check':<30}{'max error':>12}{'tolerance':>12}  result"]
    for r in results:
        error = "-" if r.max_error is None else f"{r.max_error:.3g}"
        verdict = "pass" if r.passed else "FAIL"
        rows.append(f"{r.name:<30}{error:>12}{r.tolerance:>12.3g}  {verdict}" + (f"  {r.detail}" if r.detail else ""))
    passed = sum(r.passed for r in results)
    rows.append(f"{passed}/{len(results)} checks passed")
    return "\n".join(rows)


def default_block_size(backend: KernelBackend) -> int:
    """The smallest block size the backend's kernels take (its profile sizes), else 16."""
    sizes = getattr(backend, "profile_block_sizes", None)
    return min(sizes) if sizes else 16


@click.command()
@click.option("--backend", "backend_name", type=click.Choice(list(BACKEND_NAMES)), default="cpu", show_default=True)
@click.option("--device", help="Device to run on (default: the backend's).")
@click.option("--kv-cache-dtype", "kv_dtype", type=click.Choice(["bf16", "fp16", "fp32", "int8"]), default="bf16",
              show_default=True, help="What the cache stores; int8 (C8) attends in bf16.")
@click.option("--block-size", type=int, help="Tokens per block (default: the smallest the backend's kernels take).")
def doctor(backend_name: str, device: str | None, kv_dtype: str, block_size: int | None) -> None:
    """Run every kernel a backend uses on tiny shapes against the CPU reference; exit 0 only if all pass."""
    try:
        backend = get_backend(backend_name, device)
    except BackendUnavailable as err:
        click.echo(str(err), err=True)
        sys.exit(2)
    stored = torch.int8 if kv_dtype == "int8" else torch_dtype(kv_dtype)
    setup = DoctorSetup(backend, stored, torch.bfloat16 if kv_dtype == "int8" else stored,
                        block_size or default_block_size(backend))
    version = getattr(getattr(backend, "torch_npu", None), "__version__", None)
    click.echo(
        f"kvsim doctor: {backend.name} backend on {backend.device} (torch {torch.__version__}"
        + (f", torch_npu {version}" if version else "")
        + f"); KV {kv_dtype}, block {setup.block_size}, {NUM_HEADS} heads / {NUM_KV_HEADS} kv heads x {HEAD_SIZE}"
    )
    results = run_checks(setup)
    click.echo(format_results(results))
    for warning in dict.fromkeys(getattr(backend, "preflight_warnings", [])):  # the npu preflight's, once each
        click.echo(f"warning: {warning}")
    sys.exit(0 if all(r.passed for r in results) else 1)
