"""Tensor parallelism in the real executor: the shards, the forward pass's collectives, the process group.

The yardstick is the one-device model: a TP group must generate exactly the tokens dense greedy
generation of the whole model does, so every shard (column, row, vocabulary, replicated KV head) and
every collective is right exactly when the tokens agree.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from test_executor import BS, SEED, TINY, Scenario  # noqa: E402

from kvsim.realexec.collective_bench import (  # noqa: E402
    CollectiveTiming,
    fit_topology,
    fitted_and_checked,
    predicted_s,
    step_sizes,
    time_collectives,
)
from kvsim.realexec.model import DecoderModel  # noqa: E402
from kvsim.realexec.reference import dense_generate  # noqa: E402
from kvsim.realexec.tensor_parallel import TensorParallelGroup, shard  # noqa: E402
from kvsim.realexec.tp_executor import TensorParallelExecutor, tensor_parallel_backend  # noqa: E402
from kvsim.realexec.weights import random_weights, weight_shapes  # noqa: E402
from kvsim.sim.parallel.layout import ParallelLayout, rank_model  # noqa: E402
from kvsim.sim.perf.device import load_device  # noqa: E402
from kvsim.sim.perf.model_spec import load_model  # noqa: E402


@dataclass
class Meeting:
    """Where the threads standing in for ranks leave their tensors between two barriers."""

    size: int
    slots: list = field(default_factory=list)
    barrier: threading.Barrier = None

    def __post_init__(self) -> None:
        self.slots = [None] * self.size
        self.barrier = threading.Barrier(self.size, timeout=60)

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return everyone


@dataclass
class ThreadGroup(TensorParallelGroup):
    """A TP group of threads in this process: the same collectives as gloo's, summed in rank order."""

    meeting: Meeting = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        total = self.meeting.exchange(self.rank, x)
        x.copy_(torch.stack(total).sum(0))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.meeting.exchange(self.rank, x), dim=-1)


def run_ranks(size: int, work) -> list:
    """``work(group)`` on ``size`` threads, one a rank; their results in rank order (a rank's error re-raised)."""
    meeting = Meeting(size)
    results: list = [None] * size

    def rank(r: int) -> None:
        try:
            results[r] = work(ThreadGroup(r, size, meeting=meeting))
        except BaseException as exc:  # handed to the test's thread
            results[r] = exc
            meeting.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@pytest.mark.parametrize("model, tp, ep", [("tiny", 2, False), ("tiny", 4, False), ("small-moe", 2, False),
                                           ("small-moe", 2, True), ("small-mla", 2, False),
                                           ("small-mla", 4, False)])
def test_a_tensor_parallel_group_generates_the_tokens_of_the_whole_model(model: str, tp: int, ep: bool) -> None:
    """tiny at TP4 has 2 KV heads: each is replicated on two ranks; small-moe splits every expert's
    columns, or with EP holds 4 whole experts a rank; small-mla splits heads and keeps the latent whole."""
    spec = load_model(model)
    prompt = [(17 * i + 5) % spec.vocab_size for i in range(23)]
    expected = dense_generate(DecoderModel.build(spec, seed=SEED), prompt, 6)

    def generate(group: ThreadGroup) -> list[int]:
        group.expert_parallel = ep
        return dense_generate(DecoderModel.build(spec, seed=SEED, tp=group), prompt, 6)

    assert run_ranks(tp, generate) == [expected] * tp


def test_an_expert_parallel_rank_holds_whole_experts_renumbered_and_the_whole_router() -> None:
    spec = load_model("small-moe")
    full = random_weights(spec, SEED)
    ranks = [DecoderModel.build(spec, seed=SEED, tp=TensorParallelGroup(r, 2, expert_parallel=True)) for r in range(2)]
    moe = [rank.layers[1].moe for rank in ranks]
    assert [m.first_expert for m in moe] == [0, 4] and all(m.w13.shape[0] == 4 for m in moe)
    assert torch.equal(moe[1].w2[0], full["model.layers.1.mlp.experts.4.down_proj.weight"])
    assert torch.equal(moe[0].router, full["model.layers.1.mlp.gate.weight"])


def test_shards_partition_the_whole_weights_in_the_rank_models_shapes() -> None:
    """Column shards stacked and row shards side by side give back the whole tensor; every shard has the
    shape the simulator's ``rank_model`` gives a rank, so both worlds price and hold the same rank."""
    spec = load_model("small")
    full = random_weights(spec, SEED)
    expected = weight_shapes(rank_model(spec, ParallelLayout(tensor_parallel_size=2)))
    parts = {name: [shard(spec, name, w, TensorParallelGroup(r, 2)) for r in range(2)] for name, w in full.items()}
    for name, (first, second) in parts.items():
        assert tuple(first.shape) == tuple(second.shape) == expected[name], name
    q, o, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat(parts[q]), full[q])
    assert torch.equal(torch.cat(parts[o], dim=1), full[o]) and torch.equal(torch.cat(parts[down], dim=1), full[down])
    assert torch.equal(torch.cat(parts["lm_head.weight"]), full["lm_head.weight"])
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(parts[norm][0], full[norm]) and torch.equal(parts[norm][1], full[norm])


def test_a_ranks_vocabulary_share_is_padded_when_the_ranks_do_not_divide_it() -> None:
    odd = replace(load_model("tiny"), vocab_size=load_model("tiny").vocab_size - 1)
    emb = torch.arange(odd.vocab_size * 2, dtype=torch.float32).view(odd.vocab_size, 2)
    last = shard(odd, "model.embed_tokens.weight", emb, TensorParallelGroup(1, 2))
    assert last.shape[0] == -(-odd.vocab_size // 2) and torch.equal(last[-1], torch.zeros(2))


def test_the_process_group_runs_plans_with_prefix_sharing_copy_on_write_and_swaps_and_generates_the_whole_models_tokens() -> None:
    """Two gloo ranks in two processes, driven as the one-device executor is (tests/test_executor.py):
    rank 0 hands each worker the same requests and plans, and each rank holds half the KV heads."""
    executor = TensorParallelExecutor(TINY, tensor_parallel_backend("cpu"), 2, num_blocks=64, block_size=BS,
                                      num_host_blocks=16, seed=SEED, check=True, timing_repeats=2)
    try:
        assert executor.kv_caches[0][0].shape[2] == TINY.num_kv_heads // 2
        sc = Scenario(executor)
        a = sc.add("a", 0, 40)
        b = sc.add("b", 1, 20)
        sc.tables.update(a=[0, 1, 2], b=[3, 4])
        sc.run([("a", 0, 40, True), ("b", 0, 20, True)])
        sc.decode(["a", "b"], 3)
        sc.tables["b"][-1:] = [5]  # b's last block is copied before it is written again (copy-on-write)
        sc.decode(["b"], 2, copies=[(4, 5)])
        sc.decode(["a"], 2, swap_out=[(2, 0)], swap_in=[(0, 2)])
        timed = executor.time_collectives([("all_reduce", 4096), ("all_gather", 8192)], 3)
        whole = DecoderModel.build(TINY, seed=SEED)
        assert executor.tokens("a") == dense_generate(whole, a, len(executor.tokens("a")))
        assert executor.tokens("b") == dense_generate(whole, b, len(executor.tokens("b")))
        assert [t.kind for t in timed] == ["all_reduce", "all_gather"] and all(t.median_s > 0 for t in timed)
    finally:
        executor.close()
    assert not executor._workers


def test_each_timed_collective_follows_one_of_its_own_size(monkeypatch) -> None:
    """As a step's all-reduces follow each other, each size runs twice a round and the second is timed: timed
    after a larger one, a collective carried the skew that one left between the ranks (18-29 % at 3 KB)."""
    calls: list[tuple[str, int, bool]] = []
    timing = [False]

    def recorder(kind):
        return lambda x: calls.append((kind, x.numel(), timing[0]))

    class Clock:
        device = "cpu"

        def elapsed(self, fn):
            timing[0] = True
            fn()
            timing[0] = False
            return None, 1e-5

    group = SimpleNamespace(size=2, all_reduce=recorder("all_reduce"), all_gather_last=recorder("all_gather"))
    monkeypatch.setattr("torch.distributed.barrier", lambda: None)
    timed = time_collectives(group, Clock(), [("all_reduce", 4096), ("all_gather", 8192)], 2)
    one_round = [("all_reduce", 1024, False), ("all_reduce", 1024, True), ("all_gather", 1024, False), ("all_gather", 1024, True)]
    assert calls == one_round * 2
    assert [(t.kind, t.size_bytes, t.median_s) for t in timed] == [("all_reduce", 4096, 1e-5), ("all_gather", 8192, 1e-5)]


def test_an_unknown_transport_is_named_before_any_process_starts(monkeypatch) -> None:
    monkeypatch.setenv("KVSIM_TP_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="KVSIM_TP_TRANSPORT.*carrier-pigeon"):
        tensor_parallel_backend("cpu")


def test_a_group_takes_one_device_a_rank_and_a_backend_without_collectives_none() -> None:
    """Refused before any process starts: more ranks than the backend sees devices, a backend no group is built on."""
    from torch_npu_standin import standin_npu_rank

    with pytest.raises(ValueError, match="--tensor-parallel-size 3: the npu backend sees 2 devices, and each rank takes one"):
        TensorParallelExecutor(TINY, standin_npu_rank(0), 3, num_blocks=4, block_size=128)
    with pytest.raises(ValueError, match="cpu, cuda, npu backends, not tpu"):
        tensor_parallel_backend("tpu")
    with pytest.raises(ValueError, match="cpu, cuda, npu backends, not tpu"):
        TensorParallelExecutor(TINY, SimpleNamespace(name="tpu"), 2, num_blocks=4, block_size=BS)


def test_the_link_fit_recovers_a_known_topology_and_checks_on_rows_it_did_not_see() -> None:
    """Timings made by the simulator's own formulas from a known topology: the fit must give them back."""
    base = load_device("cpu").topology
    truth = replace(base, intra_fabric="switch", intra_bandwidth=2e9, intra_latency_s=8e-5, bandwidth_efficiency=1.0,
                    reduce_efficiency=1.0)
    sizes = step_sizes(load_model("small"), 2)
    rows = [CollectiveTiming(kind, size, predicted_s(truth, 2, CollectiveTiming(kind, size, 0.0))) for kind, size in sizes]
    fitted = fit_topology(rows, 2, base)
    assert fitted.intra_latency_s == pytest.approx(8e-5, rel=1e-6)
    assert fitted.intra_bandwidth == pytest.approx(2e9, rel=1e-6)
    slower = [{**vars(r), "median_s": r.median_s * 1.25} for r in rows]
    _, checked = fitted_and_checked({"fit": [vars(r) for r in rows], "check": slower}, 2, base)
    assert [c["error"] for c in checked] == pytest.approx([1 / 1.25 - 1] * len(rows))
    with pytest.raises(ValueError, match="at least 2 sizes"):
        fit_topology([r for r in rows if r.kind == "all_gather"], 2, base)


@pytest.mark.parametrize("model, ep", [("small", False), ("small-moe", True), ("deepseek-v3", True)])
def test_a_ranks_model_file_reads_back_as_the_rank_model(tmp_path, monkeypatch, model: str, ep: bool) -> None:
    """What a tensor-parallel validation profiles on one device: the rank's model, by a name that says which."""
    from kvsim.realexec.calibration import rank_model_file

    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path))
    layout = ParallelLayout(tensor_parallel_size=2, enable_expert_parallel=ep)
    path = rank_model_file(model, layout)
    rank = rank_model(load_model(model), layout)
    if ep:  # a rank's experts see k / EP of a token's expert copies, the profiled top-k, routed over its own experts
        assert rank.scored_experts == load_model(model).num_experts
        assert load_model(path) == replace(rank, num_experts_per_tok=load_model(model).num_experts_per_tok // 2,
                                           router_experts=0)
    else:
        assert load_model(path) == rank
    assert f"{model}-tp2{'-ep' if ep else ''}-" in path and rank_model_file(model, layout) == path
