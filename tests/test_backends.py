"""cpu and cuda backends against the dense reference, plus cache management, metadata and the factory.

CUDA cases skip without a GPU; the FlashInfer case also skips where flashinfer is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvsim.realexec.backends import AttentionMetadata, BackendUnavailable, get_backend  # noqa: E402
from kvsim.realexec.backends.cache_ops import block_runs  # noqa: E402
from kvsim.realexec.backends.cpu import CpuBackend  # noqa: E402
from kvsim.realexec.backends.paged_cases import load_case, random_case  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
HAS_FLASHINFER = HAS_CUDA and importlib.util.find_spec("flashinfer") is not None
REPO = Path(__file__).resolve().parents[1]

BACKENDS = [
    "cpu",
    pytest.param("cuda-torch", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]),
    pytest.param(
        "cuda-flashinfer",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_FLASHINFER, reason="needs CUDA and flashinfer")],
    ),
]

# (query_lens, seq_lens): each sequence's new tokens are the last query_len of seq_len.
SCENARIOS = {
    "prefill": ([13, 40], [13, 40]),
    "chunked_prefill": ([24, 9], [70, 159]),
    "decode": ([1] * 8, [1, 5, 17, 33, 64, 100, 129, 200]),
    "mixed": ([30, 1, 1, 12, 1], [30, 90, 7, 140, 300]),
    # query tiles of unequal prefills: a 300-token prompt beside a 40-token chunk after 460 cached
    "long_mixed": ([300, 1, 40], [300, 77, 500]),
}
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "cpu":
        return CpuBackend()
    from kvsim.realexec.backends.cuda import CudaBackend

    kernel = request.param.split("-")[1]
    made = CudaBackend(paged_kernel=kernel)
    assert made.paged_kernel == kernel
    return made


def check_against_reference(
    backend,
    query_lens,
    seq_lens,
    *,
    num_heads=4,
    num_kv_heads=2,
    head_size=64,
    block_size=16,
    dtype=torch.float32,
    seed=0,
) -> None:
    case = random_case(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        device=backend.device,
        seed=seed,
    )
    key_cache, value_cache = load_case(backend, case)
    out = backend.attention(case.query, key_cache, value_cache, case.meta, case.scale)
    tol = TOLERANCES[dtype]
    assert out.shape == case.query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), case.expected().float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_paged_attention_matches_dense_reference(backend, scenario, block_size, dtype) -> None:
    query_lens, seq_lens = SCENARIOS[scenario]
    check_against_reference(backend, query_lens, seq_lens, block_size=block_size, dtype=dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 4, 64), (8, 1, 64), (8, 2, 128)])
def test_attention_across_head_groupings(backend, num_heads, num_kv_heads, head_size) -> None:
    query_lens, seq_lens = SCENARIOS["mixed"]
    check_against_reference(
        backend,
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.bfloat16 if HAS_CUDA else torch.float32,
    )


def test_large_decode_batch_and_long_prefill(backend) -> None:
    """The tiny model's shapes: a 32-sequence decode step and a 512-token prefill chunk."""
    gen = torch.Generator().manual_seed(3)
    decode_lens = torch.randint(1, 700, (32,), generator=gen).tolist()
    check_against_reference(backend, [1] * 32, decode_lens, block_size=16)
    check_against_reference(backend, [512], [600], block_size=128)


def test_plans_are_reused_across_layers(backend) -> None:
    """Two layers with different caches but one metadata: each must read its own cache."""
    case = random_case(
        [5, 1],
        [20, 9],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        dtype=torch.bfloat16 if HAS_CUDA else torch.float32,
        device=backend.device,
    )
    first = load_case(backend, case)
    second = (first[0] * 2, first[1].flip(-1))
    out1 = backend.attention(case.query, *first, case.meta, case.scale)
    out2 = backend.attention(case.query, *second, case.meta, case.scale)
    again = backend.attention(case.query, *first, case.meta, case.scale)
    torch.testing.assert_close(again, out1)
    assert not torch.allclose(out1, out2)


def test_write_kv_puts_each_token_at_its_slot(backend) -> None:
    key_cache, value_cache = backend.allocate_kv_cache(2, 6, 16, 2, 8, torch.float32)[1]
    key = torch.randn(5, 2, 8, device=backend.device)
    slots = torch.tensor([0, 17, 95, 40, 3], device=backend.device)
    backend.write_kv(key, key + 1, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(-1, 2, 8), value_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], key + 1)
    untouched = torch.ones(96, dtype=torch.bool, device=backend.device)
    untouched[slots] = False
    assert not flat_k[untouched].any()
    with pytest.raises(TypeError, match="dtype"):
        backend.write_kv(key.half(), key.half(), key_cache, value_cache, slots)


def test_gather_kv_returns_each_context_in_order(backend) -> None:
    case = random_case(
        [3, 1, 2],
        [3, 40, 19],
        num_heads=4,
        num_kv_heads=2,
        head_size=8,
        block_size=16,
        dtype=torch.float32,
        device=backend.device,
    )
    key_cache, value_cache = load_case(backend, case)
    key, value = backend.gather_kv(key_cache, value_cache, case.meta.block_tables, case.meta.seq_lens)
    assert torch.equal(key, case.key) and torch.equal(value, case.value)


def test_copy_blocks_copies_every_layer_reading_sources_first(backend) -> None:
    caches = backend.allocate_kv_cache(2, 5, 16, 2, 8, torch.float32)
    for layer, (k, v) in enumerate(caches):
        for block in range(5):
            k[block], v[block] = 10 * layer + block, -(10 * layer + block)
    backend.copy_blocks(caches, [(1, 2), (2, 3), (0, 4)])  # block 3 must get block 2's old contents
    for layer, (k, v) in enumerate(caches):
        assert [int(k[b, 0, 0, 0]) - 10 * layer for b in range(5)] == [0, 1, 1, 2, 0]
        assert [int(-v[b, 0, 0, 0]) - 10 * layer for b in range(5)] == [0, 1, 1, 2, 0]
    with pytest.raises(ValueError, match="destination block appears twice"):
        backend.copy_blocks(caches, [(0, 3), (1, 3)])


def test_swap_out_and_back_in_restores_blocks(backend) -> None:
    device_caches = backend.allocate_kv_cache(2, 8, 16, 2, 8, torch.float32)
    host_caches = backend.allocate_host_cache(2, 6, 16, 2, 8, torch.float32)
    assert host_caches[0][0].device.type == "cpu"
    assert host_caches[0][0].is_pinned() == (backend.device.type == "cuda")
    for k, v in device_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in device_caches]
    out_pairs = [(3, 0), (4, 1), (5, 2), (7, 5)]
    backend.swap(device_caches, host_caches, out_pairs)
    for k, v in device_caches:
        k.zero_()
        v.zero_()
    backend.swap(host_caches, device_caches, [(h, d) for d, h in out_pairs])
    backend.synchronize()
    for (k, v), (k0, v0) in zip(device_caches, before):
        for block in (3, 4, 5, 7):
            assert torch.equal(k[block], k0[block]) and torch.equal(v[block], v0[block])
        assert not k[0].any()


def test_block_runs_coalesce_consecutive_pairs() -> None:
    assert block_runs([(5, 1), (3, 7), (4, 8), (6, 2), (9, 3)]) == [(3, 7, 2), (5, 1, 2), (9, 3, 1)]
    assert block_runs([]) == []


def test_cpu_memory_in_use_counts_live_caches() -> None:
    backend = CpuBackend()
    assert backend.memory_in_use() == 0
    caches = backend.allocate_kv_cache(2, 4, 16, 2, 8, torch.float32)
    host = backend.allocate_host_cache(2, 4, 16, 2, 8, torch.float32)
    per_tensor = 4 * 16 * 2 * 8 * 4
    assert backend.memory_in_use() == 4 * per_tensor  # the host swap pool is not device memory
    del caches
    assert backend.memory_in_use() == 0
    assert host  # still alive, still not counted


def test_cpu_elapsed_counts_cpu_time_not_time_descheduled() -> None:
    backend = CpuBackend()

    def busy() -> str:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return "done"

    result, seconds = backend.elapsed(busy)
    assert result == "done" and 0.02 <= seconds < 0.5
    assert backend.elapsed(lambda: time.sleep(0.05))[1] < 0.01  # asleep, the device did no work
    assert backend.clock == "thread CPU time"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_elapsed_and_memory() -> None:
    backend = get_backend("cuda")
    before = backend.memory_in_use()
    caches = backend.allocate_kv_cache(1, 64, 16, 2, 64, torch.float16)
    assert backend.memory_in_use() - before >= 2 * caches[0][0].nbytes
    x = torch.randn(2048, 2048, device="cuda")
    result, seconds = backend.elapsed(lambda: x @ x)
    assert result.shape == (2048, 2048) and 0 < seconds < 1


def test_metadata_build_maps_new_tokens_to_slots() -> None:
    meta = AttentionMetadata.build([2, 1], [5, 17], [[7, 3], [1, 0, 4, 2, 6]], block_size=4)
    # sequence 0: positions 3, 4 -> block 7 offset 3, block 3 offset 0; sequence 1: position 16 -> block 6 offset 0
    assert meta.slot_mapping.tolist() == [31, 12, 24]
    assert meta.query_start_loc.tolist() == [0, 2, 3] and meta.seq_lens.tolist() == [5, 17]
    assert meta.block_tables.tolist() == [[7, 3, 0, 0, 0], [1, 0, 4, 2, 6]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32
    assert meta.context_lens_list == [3, 16] and not meta.is_decode_only


@pytest.mark.parametrize(
    "query_lens,seq_lens,tables,match",
    [
        ([1], [5, 6], [[0, 1]], "disagree on the batch size"),
        ([0], [5], [[0, 1]], "sequence 0: need 1 <= query_len"),
        ([6], [5], [[0, 1]], "sequence 0: need 1 <= query_len"),
        ([1, 1], [5, 9], [[0, 1], [2, 3]], "sequence 1: 2 blocks of 4 cannot hold seq_len=9"),
    ],
)
def test_metadata_build_rejects_inconsistent_lists(query_lens, seq_lens, tables, match) -> None:
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(query_lens, seq_lens, tables, block_size=4)


def test_metadata_memo_derives_once() -> None:
    meta = AttentionMetadata.build([1], [3], [[0]], block_size=4)
    calls = []
    assert meta.memo("k", lambda: calls.append(1) or 42) == 42
    assert meta.memo("k", lambda: calls.append(1) or 43) == 42
    assert calls == [1]


def test_factory_names_and_errors() -> None:
    assert get_backend("cpu").name == "cpu"
    with pytest.raises(ValueError, match="unknown backend 'tpu'; choose one of cpu, cuda, npu"):
        get_backend("tpu")
    with pytest.raises(ValueError, match="runs on 'cpu'"):
        get_backend("cpu", "cuda:0")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given where CUDA is missing")
def test_cuda_unavailable_is_one_line() -> None:
    with pytest.raises(BackendUnavailable) as err:
        get_backend("cuda")
    assert str(err.value).startswith("cuda backend unavailable: ") and "\n" not in str(err.value)


def _python(code: str, extra_path: Path) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    environ["PYTHONPATH"] = os.pathsep.join([str(extra_path), str(REPO)])
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=REPO, timeout=120
    )


def test_importing_backends_survives_a_torch_npu_wheel_without_cann(tmp_path: Path) -> None:
    """A torch_npu that fails to load (as without CANN) breaks bare ``import torch`` but not kvsim's.

    The fake wheel registers the same ``torch.backends`` entry point as torch_npu 2.13.0.
    """
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory. "
        "Please check that the cann package is installed.')\n"
    )
    dist = tmp_path / "torch_npu-2.13.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")

    bare = _python("import torch", tmp_path)
    assert bare.returncode != 0 and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in bare.stderr

    code = (
        "import realexec.backends as b, torch, os\n"
        "print(os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'], b.get_backend('cpu').name)\n"
        "try:\n    b.get_backend('npu')\nexcept b.BackendUnavailable as e:\n    print(e)\n"
    )
    guarded = _python(code, tmp_path)
    assert guarded.returncode == 0, guarded.stderr
    lines = guarded.stdout.splitlines()
    assert lines[0] == "0 cpu"
    assert lines[1].startswith("npu backend unavailable: torch_npu failed to import (libhccl.so: cannot open")
    assert len(lines) == 2


@pytest.mark.parametrize("user_value,expected", [(None, "0"), ("1", "1")])
def test_autoload_is_switched_off_unless_the_user_chose(monkeypatch, user_value, expected) -> None:
    import kvsim.realexec.backends as backends_package

    if user_value is None:
        monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    else:
        monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", user_value)
    importlib.reload(backends_package)
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == expected


def test_cpu_clock_settings_come_from_the_environment_and_name_the_variable(monkeypatch) -> None:
    from kvsim.realexec.backends.cpu import CpuBackend

    monkeypatch.setenv("KVSIM_CPU_TIMING_REPEATS", "3")
    backend = CpuBackend()
    assert backend.timing_repeats == 3 and "median of 3 timed runs per step" in backend.fingerprint_parts()
    for name, bad in (("KVSIM_CPU_TIMING_REPEATS", "0"), ("KVSIM_CPU_THREADS", "two")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name} must be a positive integer, not '{bad}'"):
            CpuBackend()
        monkeypatch.delenv(name)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt and per-thread rusage are Linux facts")
def test_cpu_backend_keeps_freed_memory_so_steps_do_not_fault_in_fresh_pages() -> None:
    import resource

    from kvsim.realexec.backends.cpu import CpuBackend

    assert CpuBackend().keeps_freed_memory

    def faults_of_a_fresh_4_mib_tensor() -> int:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        torch.ones(1024 * 1024, dtype=torch.float32).sum()
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    faults_of_a_fresh_4_mib_tensor()  # the heap grows once
    assert faults_of_a_fresh_4_mib_tensor() < 64  # unmapped on free it would fault in about 1,024 pages again
