"""The engine, the driver and the real executor together: every paged decision leaves the
generated tokens exactly as a dense, cache-free run of the same model would produce them.

Prefix-cache hits, chunked prefill, forks with copy-on-write, and preemption by recompute and
by swap all move or share KV; any slip in a block table, slot or copy changes a greedy token.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvsim import traces  # noqa: E402
from kvsim.policies.config import EngineConfig  # noqa: E402
from kvsim.policies.engine import EngineCore  # noqa: E402
from kvsim.policies.request import Status  # noqa: E402
from kvsim.realexec.backends import get_backend  # noqa: E402
from kvsim.realexec.backends.npu import NpuBackend  # noqa: E402
from torch_npu_standin import make_torch_npu_standin  # noqa: E402
from kvsim.realexec.executor import Executor  # noqa: E402
from kvsim.realexec.prompts import prompt_tokens  # noqa: E402
from kvsim.realexec.reference import dense_generate  # noqa: E402
from kvsim.sim.model_spec import load_model  # noqa: E402
from kvsim.sim.simulator import SimOptions, simulate  # noqa: E402

SPEC = load_model("tiny")


def pressure_trace():
    """Two-turn conversations over a shared system prompt, every fourth with two samples, arriving at once."""
    base = traces.synthesize(rate=400.0, n_requests=14, prompt=traces.Uniform(20, 90), output=traces.Uniform(6, 20),
                             system_prompt_tokens=48, turns=2, think_time_s=0.01, hash_block_size=16, seed=11)
    return replace(base, n_samples=np.asarray([2 if i % 4 == 1 else 1 for i in range(len(base))], dtype=np.int64))


def run_paged(backend, mode: str, block_size: int, kv_dtype: str | None = None):
    trace = pressure_trace()
    config = EngineConfig(num_blocks=40 if block_size == 16 else 6, block_size=block_size, num_host_blocks=64,
                          max_model_len=512, max_num_batched_tokens=48, max_num_seqs=8, scheduler="fcfs",
                          block_manager="prefix", preemption_mode=mode, batch_blocks_within_pool=backend.name == "npu")
    engine = EngineCore(config)
    executor = Executor(SPEC, backend, config.num_blocks, block_size, config.num_host_blocks, seed=5,
                        kv_dtype=kv_dtype, check=True)
    simulate(trace, engine, executor, SimOptions(exact=True, check=True))
    return trace, engine, executor


def assert_matches_dense(engine, executor):
    for request in engine.requests.values():
        assert request.status is Status.FINISHED, request.request_id
        root = request.parent or request
        prompt = prompt_tokens(root, SPEC.vocab_size, seed=5)
        expected = dense_generate(executor.model, prompt, request.output_tokens, executor.kv_dtype)
        assert executor.tokens(request.request_id) == expected, request.request_id


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cpu_paged_run_equals_dense_run(mode):
    _, engine, executor = run_paged(get_backend("cpu"), mode, block_size=16)
    stats = engine.kv_stats()
    assert stats.prefix_hit_tokens > 0, "the shared system prompt must be served from the cache"
    assert stats.copies > 0, "forked samples must copy their shared partial block before writing"
    assert engine.counters.preemptions > 0
    if mode == "swap":
        assert engine.counters.swap_preemptions > 0
    assert max(r.prompt_tokens for r in engine.requests.values()) > engine.config.max_num_batched_tokens  # chunked
    assert_matches_dense(engine, executor)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_npu_backend_through_the_standin_equals_dense_run(mode):
    """The npu backend's documented kernel calls, checked by the stand-in, on fp32 weights with bf16 KV."""
    backend = NpuBackend("cpu", torch_npu_module=make_torch_npu_standin())
    _, engine, executor = run_paged(backend, mode, block_size=128, kv_dtype="bf16")
    assert engine.counters.preemptions > 0
    assert_matches_dense(engine, executor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cuda_paged_run_equals_dense_run(mode):
    _, engine, executor = run_paged(get_backend("cuda"), mode, block_size=16)
    assert_matches_dense(engine, executor)
