"""A KV store the instances share (policies/kv_store.py), as Mooncake Store keeps it: puts of
computed blocks, reads that copy, LRU eviction, the read's time, conservation, and the cluster's
configuration and figures."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.cli.main import main
from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.policies.kv_store import SharedKVStore, StoreSpec, share_store
from kvsim.policies.kv_tiers import KVTiers, TierConfig, TierSpec
from kvsim.sim.perf.device import load_device
from kvsim.sim.run.config import RunConfig, resolve

BS = 4
NO_TIER = TierSpec(0, 0.0, 0.0)


def store_spec(capacity: int) -> StoreSpec:
    # 2 MB blocks of 2 ranks; a rank's 1 MB shard over a 1 GB/s card: 1 ms a block, 0.1 ms a read
    return StoreSpec(capacity, bandwidth=1e9, latency_s=1e-4, block_bytes=2 * 10**6, rank_block_bytes=10**6)


def store_engine(capacity: int, num_blocks: int = 8, host: int = 0) -> EngineCore:
    tiers = TierConfig(TierSpec(host, 1e9, 1e-4) if host else NO_TIER, NO_TIER, block_bytes=10**6, prefetch_steps=0,
                       store=store_spec(capacity))
    return EngineCore(EngineConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64, max_num_seqs=4,
                                   max_num_batched_tokens=64, kv_tiers=tiers))


def prompt(family: int, blocks: int) -> tuple[int, ...]:
    return tuple(1000 * family + i for i in range(blocks * BS))


def serve(engine: EngineCore, rid: str, tokens: tuple[int, ...], now: float = 0.0) -> float:
    """One request alone, to the end (invariants checked every step); returns the first step's
    wait for KV from the store."""
    engine.add_request(rid, now, len(tokens), 1, token_ids=tokens)
    waits = []
    while engine.has_unfinished():
        plan = engine.schedule(now)
        waits.append(engine.kv_tiers.exposed_s(now))
        now += 1.0
        engine.commit(plan, now)
        engine.check_invariants()
    return waits[0]


def test_puts_skip_held_keys_and_evict_the_least_recently_used() -> None:
    store = SharedKVStore(store_spec(capacity=3))
    assert store.put([1, 2, 3]) == 3
    assert store.put([2, 3]) == 0  # held: not written again
    store.get([1])  # a read refreshes 1: 2 is now the least recently used
    assert store.put([4]) == 1
    assert list(store.blocks) == [3, 1, 4] and store.stats.evicted == 1
    assert (store.stats.put, store.stats.put_skipped, store.stats.got) == (4, 2, 1)
    store.check()


def test_a_prefix_one_engine_computed_is_read_by_another() -> None:
    """Two engines share a store: the second finds the first's prompt blocks there and reads them
    (one rank's shards over one card) instead of recomputing; the store keeps its copy."""
    a, b = store_engine(capacity=16), store_engine(capacity=16)
    shared = share_store([a.kv_tiers, b.kv_tiers])
    assert b.kv_tiers.store is shared is a.kv_tiers.store
    tokens = prompt(1, 3) + (7,)  # 3 full blocks, then one token
    assert serve(a, "a", tokens) == 0.0
    assert shared.stats.put == 3 and len(shared.blocks) == 3
    wait = serve(b, "b", tokens)
    assert wait == pytest.approx(1e-4 + 3 * 10**6 / 1e9)  # prefetch 0: the step waits for the whole read
    stats = b.kv_stats()
    assert stats.prefix_hit_tokens == 3 * BS and b.kv_tiers.stats.store_tokens == 3 * BS
    assert shared.stats.got == 3 and len(shared.blocks) == 3  # a copy: still held
    summary = b.kv_tiers.summary(stats.prefix_query_tokens, stats.prefix_hit_tokens)
    assert summary["tokens"]["store"] == 3 * BS and summary["bytes"]["store_to_hbm"] == 3 * 2 * 10**6
    assert summary["bytes"]["hbm_to_store"] == 0  # b computed nothing new that the store lacked


def test_without_a_shared_store_the_second_engine_recomputes() -> None:
    a, b = store_engine(capacity=16), store_engine(capacity=16)  # each its own store
    tokens = prompt(1, 3) + (7,)
    serve(a, "a", tokens)
    serve(b, "b", tokens)
    assert b.kv_stats().prefix_hit_tokens == 0 and b.kv_tiers.store.stats.put == 3


def test_only_blocks_still_indexed_when_the_step_runs_are_put() -> None:
    """A block registered for a step and freed before it ran (its request preempted in the same
    schedule) holds no KV: it is not put."""
    tiers = KVTiers(TierConfig(NO_TIER, NO_TIER, 10**6, 0, store=store_spec(8)), device_index={11: 0, 13: 1})
    tiers.computed([11, 12, 13])
    assert tiers.exposed_s(0.0) == 0.0
    assert list(tiers.store.blocks) == [11, 13] and tiers.stats.put_to_store == 2


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 2), st.integers(1, 3), st.integers(0, 2)),
             min_size=1, max_size=25),
    st.integers(1, 6), st.integers(0, 3),
)
def test_blocks_are_conserved_over_engines_sharing_a_small_store(requests, capacity, host) -> None:
    """Random requests from a few prefix families over three engines sharing a small store, each
    with a host tier or none: after every step the tiers and the store pass their checks (every
    block put is held or evicted, within capacity; local tiers as before), and all drain."""
    engines = [store_engine(capacity, num_blocks=12, host=host) for _ in range(3)]
    share_store([e.kv_tiers for e in engines])
    now, step = 0.0, 0
    pending = list(enumerate(requests))
    while pending or any(e.has_unfinished() for e in engines):
        while pending and pending[0][1][2] <= step:
            i, (family, blocks, _, output, where) = pending.pop(0)
            tokens = prompt(family, blocks) + (9,) * (i % 3)
            engines[where].add_request(f"r{i}", now, len(tokens), output, token_ids=tokens)
        step += 1
        for engine in engines:
            plan = engine.schedule(now)
            engine.kv_tiers.exposed_s(now)
            engine.commit(plan, now + 1.0)
            engine.check_invariants()
        now += 1.0
        assert step < 2000
    for engine in engines:
        stats = engine.kv_stats()
        tokens = engine.kv_tiers.summary(stats.prefix_query_tokens, stats.prefix_hit_tokens)["tokens"]
        assert min(tokens.values()) >= 0


def test_resolve_sizes_the_store_over_every_rank_and_reads_over_the_network_card() -> None:
    resolved = resolve(RunConfig(kv_store_gb=64.0, tensor_parallel_size=2))
    spec = resolved.engine_config.kv_tiers.store
    rank_bytes = resolved.memory.bytes_per_block
    topology = load_device("ascend-910b3").topology
    assert (spec.rank_block_bytes, spec.block_bytes) == (rank_bytes, 2 * rank_bytes)
    assert spec.capacity_blocks == 64 * 2**30 // (2 * rank_bytes)
    assert spec.bandwidth == topology.inter_bandwidth * topology.inter_efficiency
    assert resolved.to_dict()["resolved"]["kv_tier_blocks"]["store"] == spec.capacity_blocks
    assert resolve(RunConfig()).engine_config.kv_tiers is None


@pytest.mark.parametrize(("args", "field"), [
    (["--kv-store-gb", "-1"], "kv_store_gb"),
    (["--kv-store-gb", "8", "--block-manager", "paged"], "kv_store_gb"),
    (["--kv-store-gb", "1e-9"], "kv_store_gb"),  # holds no block
    (["--kv-store-gb", "8", "--device", "rtx-3090"], "kv_store_gb"),  # no network card stated
    (["--kv-store-gb", "8", "--instances", "2", "--cluster-workers", "2", "--router-staleness", "1"], "cluster_workers"),
])
def test_bad_store_input_is_one_line_exit_2(args, field, tmp_path) -> None:
    result = CliRunner().invoke(main, ["simulate", "--quiet", "--max-requests", "5", *args, "--out", str(tmp_path / "run")])
    output = result.output.strip()
    assert result.exit_code == 2, output
    assert len(output.splitlines()) == 1 and field in output and "Traceback" not in output
    assert not (tmp_path / "run").exists()


def test_a_shared_store_raises_the_clusters_prefix_hit_rate_and_its_page_shows_it(tmp_path) -> None:
    common = ["simulate", "--quiet", "--decisions", "off", "--trace", "mooncake_500", "--max-requests", "250",
              "--model", "qwen2.5-7b", "--max-model-len", "131072", "--instances", "3", "--router", "round-robin"]
    runner = CliRunner()
    assert runner.invoke(main, [*common, "--out", str(tmp_path / "off")]).exit_code == 0
    result = runner.invoke(main, [*common, "--kv-store-gb", "256", "--check", "--out", str(tmp_path / "on")])
    assert result.exit_code == 0, result.output
    off = json.loads((tmp_path / "off" / "summary.json").read_text())
    on = json.loads((tmp_path / "on" / "summary.json").read_text())
    assert "kv_store" not in off and on["prefix_hit_rate"] > off["prefix_hit_rate"]
    store = on["kv_store"]
    from_store = [s["kv_tiers"]["tokens"]["store"] for s in on["instances"]]
    assert all(t > 0 for t in from_store) and "kv_store" not in on["instances"][0]
    assert store["blocks_read"] == sum(s["kv_tiers"]["bytes"]["store_to_hbm"] for s in on["instances"]) // (
        store["bytes_read"] // store["blocks_read"])
    assert store["blocks_put"] == store["blocks_held"] + store["blocks_evicted"]
    page = runner.invoke(main, ["report", "cluster", str(tmp_path / "on"), "--out", str(tmp_path / "page.html")])
    assert page.exit_code == 0, page.output
    html = (tmp_path / "page.html").read_text()
    assert f"Shared KV store: {store['capacity_blocks']} blocks" in html and "store -&gt; hbm (GB)" in html


def test_in_a_pd_cluster_the_prefill_pool_shares_the_store_and_the_decode_pool_keeps_out(tmp_path) -> None:
    args = ["simulate", "--quiet", "--decisions", "off", "--trace", "mooncake_500", "--max-requests", "60",
            "--model", "qwen2.5-7b", "--max-model-len", "32768", "--prefill-instances", "2", "--decode-instances", "1",
            "--kv-store-gb", "64", "--check", "--out", str(tmp_path / "pd")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "pd" / "summary.json").read_text())
    prefill = [s for s in summary["instances"] if s["pool"] == "prefill"]
    decode = [s for s in summary["instances"] if s["pool"] == "decode"]
    assert all("store" in s["kv_tiers"]["tokens"] for s in prefill) and all("kv_tiers" not in s for s in decode)
    assert summary["kv_store"]["blocks_put"] > 0
