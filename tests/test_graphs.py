"""Steps replayed as captured graphs, and the token-addressed attention they run.

A CPU has no CUDA graphs, so the executor's graph path is driven here through a stand-in graph
that reruns the captured function on replay: what that checks is everything around the graph
(static buffers refilled per step, padding rows, sizes, the attention path that reads device
tensors only). The CUDA graphs and the Triton kernel themselves run in the tests marked ``gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from graph_standin import VLLM_SIZES, GraphingCpuBackend, RerunGraph  # noqa: E402

from kvsim.realexec.backends import get_backend  # noqa: E402
from kvsim.realexec.backends.base import AttentionMetadata  # noqa: E402
from kvsim.realexec.backends.portable import paged_attention  # noqa: E402
from kvsim.realexec.backends.token_attention import TokenMetadata, token_paged_attention  # noqa: E402
from kvsim.realexec.graphs import GraphInputs, StepGraphs, engine_of  # noqa: E402
from kvsim.realexec.model import DecoderModel  # noqa: E402
from kvsim.sim.perf.device import load_device  # noqa: E402
from kvsim.sim.perf.model_spec import load_model  # noqa: E402

SPEC = load_model("tiny")


def random_batch(rng: np.random.Generator, block_size: int, num_blocks: int, query_lens: list[int], context: list[int]):
    """Metadata of a mixed batch on shuffled blocks, and random caches and queries (fp32)."""
    seq_lens = [c + q for c, q in zip(context, query_lens)]
    order = rng.permutation(num_blocks).tolist()
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(order[:n])
        order = order[n:]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    kc, vc = (torch.randn(num_blocks, block_size, 2, 32, generator=gen) for _ in range(2))
    q = torch.randn(sum(query_lens), 4, 32, generator=gen)
    return meta, kc, vc, q


@pytest.mark.parametrize("seed", range(4))
def test_token_attention_equals_the_portable_kernels(seed):
    rng = np.random.default_rng(seed)
    meta, kc, vc, q = random_batch(rng, 16, 64, [1, 7, 1, 33, 1], [40, 0, 3, 20, 90])
    expected = paged_attention(q, kc, vc, meta, 0.2)
    got = token_paged_attention(q, kc, vc, TokenMetadata.from_meta(meta), 0.2)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_token_attention_ignores_table_entries_past_a_tokens_position():
    rng = np.random.default_rng(7)
    meta, kc, vc, q = random_batch(rng, 16, 64, [1, 3], [17, 5])
    tokens = TokenMetadata.from_meta(meta)
    widened = TokenMetadata(tokens.token_seq, tokens.positions,
                            torch.cat([tokens.block_tables, torch.full((2, 3), 63, dtype=torch.int32)], dim=1))
    kc[63], vc[63] = 1e4, 1e4  # a block no token may see
    assert torch.equal(token_paged_attention(q, kc, vc, widened, 0.2), token_paged_attention(q, kc, vc, tokens, 0.2))


def test_a_step_replays_at_the_smallest_capture_size_that_holds_it():
    backend = GraphingCpuBackend()
    model = DecoderModel.build(SPEC, "cpu", seed=0)
    graphs = StepGraphs(backend, model, lambda meta: None, VLLM_SIZES, 8, 16, pad_slot=999)
    assert [graphs.size_for(n) for n in (1, 3, 5, 8, 9, 250, 257, 512)] == [1, 4, 8, 8, 16, 256, 272, 512]
    assert graphs.size_for(513) is None and graphs.size_for(0) is None
    with pytest.raises(ValueError, match="increasing"):
        StepGraphs(backend, model, lambda meta: None, (4, 2), 8, 16, pad_slot=999)


def test_loaded_steps_pad_with_their_last_token_writing_to_the_pad_slot():
    backend = GraphingCpuBackend()
    graphs = StepGraphs(backend, DecoderModel.build(SPEC, "cpu", seed=0), lambda meta: None, (1, 2, 4, 8), 4, 16, pad_slot=64)
    graphs.load(GraphInputs([5, 6, 7], [10, 11, 3], [170, 171, 35], [0, 0, 1], [[3, 10], [2]], [2, 1], [12, 4]), 8)
    assert graphs.input_ids.tolist() == [5, 6, 7, 7, 7, 7, 7, 7]
    assert graphs.positions.tolist() == [10, 11, 3, 3, 3, 3, 3, 3]
    assert graphs.slots.tolist() == [170, 171, 35, 64, 64, 64, 64, 64]
    assert graphs.token_seq.tolist() == [0, 0, 1, 1, 1, 1, 1, 1] and graphs.num_real.item() == 3
    assert graphs.block_tables[:2, :2].tolist() == [[3, 10], [2, 0]]
    assert (graphs.query_lens, graphs.seq_lens) == ([2, 1], [12, 4])  # the captured metadata's host lists
    with pytest.raises(ValueError, match="does not fit"):
        graphs.load(GraphInputs([1] * 3, [0] * 3, [0] * 3, [0] * 3, [[0] * 5], [3], [3]), 4)


def test_a_graphing_executor_describes_itself_as_graph_mode_without_dispatch():
    from kvsim.realexec.executor import Executor

    backend = GraphingCpuBackend()
    executor = Executor(SPEC, backend, num_blocks=16, block_size=16)
    engine = engine_of(executor.graphs)
    assert engine.mode == "graph" and engine.dispatch_s == 0.0 and engine.capture_sizes == VLLM_SIZES
    assert engine_of(Executor(SPEC, get_backend("cpu"), num_blocks=16, block_size=16).graphs) is None
    assert Executor(SPEC, backend, num_blocks=16, block_size=16, kv_dtype="int8").graphs is None  # int8: eager


def test_each_executor_captures_into_a_memory_pool_of_its_own():
    """validate runs the speed check's executor, then the real run's, on one backend: the second must
    not capture into the first's pool once its graphs are gone (the CUDA allocator asserts). The
    profiler's one-off graphs go into their executor's pool, beside its step graphs."""
    from kvsim.realexec.executor import Executor
    from kvsim.realexec.profile_bench import OperatorBenches

    backend = GraphingCpuBackend()
    first, second = (Executor(SPEC, backend, num_blocks=16, block_size=16) for _ in range(2))
    assert backend.pools == [first.graphs.pool, second.graphs.pool] and first.graphs.pool is not second.graphs.pool
    one_off = OperatorBenches(second, np.random.default_rng(0), 0)._captured(lambda: None)
    assert one_off.pool is second.graphs.pool


def test_no_dead_graph_is_collected_while_a_graph_is_captured():
    """A garbage collection during a capture frees dead graphs, whose CUDA destructors then invalidate
    the capture: the executor's step graphs and the profiler's one-off graphs are captured with the
    collector paused, and the dead ones collected after. Here a cycle that dies in the capture records, when
    collected, whether a capture is under way; the collector runs after every allocation, so unpaused it is."""
    import gc

    from kvsim.realexec.executor import Executor
    from kvsim.realexec.profile_bench import OperatorBenches

    capturing, collected_during = [False], []

    class Dead:
        def __init__(self) -> None:
            self.cycle = self

        def __del__(self) -> None:
            collected_during.append(capturing[0])

    class WatchedGraph(RerunGraph):
        def capture(self, fn) -> None:
            capturing[0] = True
            try:
                Dead()  # garbage that only a collection frees, as a released executor's graphs are
                [object() for _ in range(100)]  # allocations: an enabled collector would run here
                super().capture(fn)
            finally:
                capturing[0] = False

    backend = GraphingCpuBackend()
    backend.new_graph = lambda pool: WatchedGraph(pool)
    executor = Executor(SPEC, backend, num_blocks=16, block_size=16)
    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1)
    try:
        for make in (lambda: executor.graphs.ensure_captured(8),
                     lambda: OperatorBenches(executor, np.random.default_rng(0), 0)._captured(lambda: None)):
            make()
            gc.collect()
    finally:
        gc.set_threshold(*threshold)
    assert collected_during == [False, False]


def test_no_timed_replay_is_a_graphs_first_launch():
    """A graph's first launch is slower than its later ones (on an H200 up to 1.14x for a fresh prefill
    size): the executor's step graphs and the profiler's one-off graphs are launched once untimed right
    after capture, so a size's first step and a graph-timed operator case time a later launch."""
    from kvsim.realexec.executor import Executor
    from kvsim.realexec.profile_bench import OperatorBenches

    launches: list[tuple[str, int]] = []  # (which graph, its launch count) at every launch, in order

    class CountingGraph(RerunGraph):
        def replay(self) -> None:
            super().replay()
            launches.append((self.name, self.replays))

    backend = GraphingCpuBackend()
    executor = Executor(SPEC, backend, num_blocks=16, block_size=16)
    names = iter(["step", "operator"])

    def new_graph(pool):
        graph = CountingGraph(pool)
        graph.name = next(names)
        return graph

    backend.new_graph = new_graph
    executor.graphs.load(GraphInputs([1, 2], [0, 1], [0, 1], [0, 0], [[0]], [2], [2]), 8)
    executor.graphs.ensure_captured(8)
    assert launches == [("step", 1)]  # the untimed launch, at capture
    executor.graphs.replay(8)
    assert OperatorBenches(executor, np.random.default_rng(0), 0)._timed(lambda: None) >= 0
    assert launches == [("step", 1), ("step", 2), ("operator", 1), ("operator", 2)]


def test_the_cpu_backend_runs_eagerly_and_keeps_its_fingerprint():
    backend = get_backend("cpu")
    assert backend.capture_sizes == () and not any("graphs" in part for part in backend.fingerprint_parts())
    assert any("graphs at 51 sizes up to 512" == part for part in GraphingCpuBackend().fingerprint_parts())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_kernel_equals_the_token_reference(dtype):
    from kvsim.realexec.backends import triton_attention

    if not triton_attention.available():
        pytest.skip("triton is not installed")
    rng = np.random.default_rng(3)
    meta, kc, vc, q = random_batch(rng, 16, 64, [1, 7, 1, 33, 1], [40, 0, 3, 20, 90])
    kc, vc, q = (x.to("cuda", dtype) for x in (kc, vc, q))
    tokens = TokenMetadata.from_meta(meta)
    tokens = TokenMetadata(*(t.to("cuda") for t in (tokens.token_seq, tokens.positions, tokens.block_tables)))
    assert triton_attention.supports(q, kc)
    got = triton_attention.token_paged_attention_triton(q, kc, vc, tokens, 0.2).float()
    expected = token_paged_attention(q.double(), kc.double(), vc.double(), tokens, 0.2).float()
    tolerance = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert ((got - expected).norm() / expected.norm()).item() < tolerance
    # A captured batch's padding rows (from num_real on) attend to nothing; the real rows do not change.
    padded = TokenMetadata(tokens.token_seq, tokens.positions, tokens.block_tables,
                           num_real=torch.tensor([40], dtype=torch.int32, device="cuda"))
    with_padding = triton_attention.token_paged_attention_triton(q, kc, vc, padded, 0.2).float()
    assert torch.equal(with_padding[:40], got[:40]) and not with_padding[40:].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backend_replays_steps_as_graphs_unless_eager():
    assert get_backend("cuda").capture_sizes == VLLM_SIZES
    assert get_backend("cuda", enforce_eager=True).capture_sizes == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_executors_one_after_another_capture_graphs_on_one_cuda_backend():
    """validate's order on one backend: the speed check's executor, gone, then the next one's graphs.

    With one pool handle kept for the backend's life, validate runs stopped on the allocator's
    ``use_count > 0`` assert as the next executor captured (11 of 27 runs on an H200); this
    test repeats that order (it passed there with a first version of the fix; the old code was
    not run through it).
    """
    import gc

    from kvsim.realexec.speed_check import reference_times

    backend = get_backend("cuda")
    for _ in range(3):
        measured, _ = reference_times(backend, load_model("small"), 16, "fp32")
        gc.collect()
        assert all(seconds > 0 for seconds in measured)


# -- the npu backend: ACLGraph through the torch_npu stand-in (tests/torch_npu_standin.py) -----------------

ASCEND_SIZES = load_device("ascend-910b3").engine.capture_sizes


@pytest.mark.filterwarnings("ignore::kvsim.realexec.backends.npu_preflight.PreflightWarning")
def test_npu_backend_replays_steps_at_the_910b_profile_sizes_unless_eager(monkeypatch):
    import sys

    from torch_npu_standin import make_torch_npu_standin

    monkeypatch.setitem(sys.modules, "torch_npu", make_torch_npu_standin())
    assert get_backend("npu", "cpu").capture_sizes == ASCEND_SIZES
    eager = get_backend("npu", "cpu", enforce_eager=True)
    assert eager.capture_sizes == () and not any("graphs" in part for part in eager.fingerprint_parts())


def test_npu_graph_attention_pads_the_step_with_one_dummy_request():
    """FIA's TND lengths must cover every query row: the padding rows form one request over as many positions."""
    from kvsim.realexec.backends.npu_graphs import fia_step_args

    meta = AttentionMetadata.build([2, 1], [12, 4], [[3], [2]], 128)
    meta.block_tables = torch.zeros(8, 4, dtype=torch.int32)  # a graph's static table: rows for the largest size
    args = fia_step_args(meta, 8)
    assert args["actual_seq_lengths"] == [2, 3, 8] and args["actual_seq_lengths_kv"] == [12, 4, 5]
    assert args["block_table"].shape == (3, 4)
    unpadded = fia_step_args(meta, 3)
    assert unpadded["actual_seq_lengths"] == [2, 3] and unpadded["actual_seq_lengths_kv"] == [12, 4]
    with pytest.raises(ValueError, match="does not fit"):
        fia_step_args(meta, 2)


@pytest.mark.filterwarnings("ignore::kvsim.realexec.backends.npu_preflight.PreflightWarning")
def test_the_graph_token_check_passes_on_the_npu_standin(monkeypatch, capsys):
    """benchmarks/graph_tokens.py, the first graph check docs/npu-bring-up.md asks for on a device, here on the stand-in."""
    import importlib.util
    import sys
    from pathlib import Path

    from torch_npu_standin import make_torch_npu_standin

    monkeypatch.setitem(sys.modules, "torch_npu", make_torch_npu_standin())
    path = Path(__file__).parents[1] / "benchmarks" / "graph_tokens.py"
    spec = importlib.util.spec_from_file_location("graph_tokens", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "graph_tokens", module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    assert module.main(["--backend", "npu", "--device", "cpu", "--requests", "2"]) == 0
    assert "generated the same tokens with graphs as eagerly" in capsys.readouterr().out
