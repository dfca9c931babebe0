"""KV tiers below HBM (policies/kv_tiers.py): demotion on eviction, promotion on a lookup that
misses HBM, the transfer's exposed time, conservation, and the run's configuration."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.cli.main import main
from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.policies.kv_tiers import KVTiers, TierConfig, TierSpec
from kvsim.sim.perf.device import load_device
from kvsim.sim.run.config import RunConfig, resolve

BS = 4


def tiers_config(host: int, ssd: int, prefetch: int = 1) -> TierConfig:
    # 1 MB blocks over a 1 GB/s host link (1 ms a block) and a 0.5 GB/s SSD (2 ms a block)
    return TierConfig(TierSpec(host, 1e9, 1e-4), TierSpec(ssd, 5e8, 1e-3), block_bytes=10**6, prefetch_steps=prefetch)


def tiered_engine(host: int, ssd: int, num_blocks: int = 8) -> EngineCore:
    return EngineCore(EngineConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64, max_num_seqs=4,
                                   max_num_batched_tokens=64, kv_tiers=tiers_config(host, ssd)))


def prompt(family: int, blocks: int) -> tuple[int, ...]:
    return tuple(1000 * family + i for i in range(blocks * BS))


def serve(engine: EngineCore, rid: str, tokens: tuple[int, ...], now: float) -> float:
    """One request alone, to the end (invariants checked every step); returns the time after it."""
    request = engine.add_request(rid, now, len(tokens), 1, token_ids=tokens)
    while engine.has_unfinished():
        plan = engine.schedule(now)
        now += 1.0
        engine.commit(plan, now)
        engine.check_invariants()
    return now if request.first_token_s is not None else -1.0


def test_lru_demotion_host_then_ssd_then_dropped() -> None:
    tiers = KVTiers(tiers_config(host=2, ssd=1))
    for h in (1, 2, 3, 4):
        tiers.demote(h)
    assert list(tiers.host) == [3, 4] and list(tiers.ssd) == [2]  # 1: host -> SSD -> dropped by 2
    assert tiers.stats.dropped == 1 and tiers.stats.demoted_to_ssd == 2
    assert tiers.promote([4, 2], arrival_s=0.0) == (1, 1, 0)
    assert 4 not in tiers and 2 not in tiers and 3 in tiers
    tiers.check(set())


def test_an_evicted_prefix_comes_back_from_the_host_tier() -> None:
    engine = tiered_engine(host=8, ssd=0)
    now = serve(engine, "a", prompt(1, 3), 0.0)  # 3 full blocks cached (the last prompt block is kept whole)
    a_hashes = set(engine.kv.pool.cached)
    now = serve(engine, "b", prompt(2, 8), now)  # the whole pool: every cached block of a is evicted
    tiers = engine.kv_tiers
    assert a_hashes and a_hashes <= set(tiers.host) and not a_hashes & set(engine.kv.pool.cached)
    c = engine.add_request("c", now, 3 * BS + 2, 1, token_ids=prompt(1, 3) + (7, 7))
    assert engine.kv.lookup(c) == 3 * BS  # all three from the host tier
    plan = engine.schedule(now)
    assert c.prefix_hit_tokens == 3 * BS and [e.num_tokens for e in plan.entries] == [2]
    assert not a_hashes & set(tiers.host) and a_hashes <= set(engine.kv.pool.cached)  # moved, not copied
    assert tiers.stats.promoted_from_host == 3 and tiers.stats.host_tokens == 3 * BS
    # it arrived at this step's start, so nothing could be prefetched: the step waits for all of it
    assert tiers.exposed_s(now) == pytest.approx(1e-4 + 3 * 1e-3)
    engine.commit(plan, now + 1.0)
    engine.check_invariants()
    stats = engine.kv_stats()
    summary = tiers.summary(stats.prefix_query_tokens, stats.prefix_hit_tokens)
    assert summary["tokens"]["host"] == 3 * BS and summary["tokens"]["hbm"] == 0
    assert summary["bytes"]["host_to_hbm"] == 3 * 10**6
    assert sum(summary["hit_rate"].values()) == pytest.approx(1.0)


def test_without_tiers_the_evicted_prefix_is_recomputed() -> None:
    engine = EngineCore(EngineConfig(num_blocks=8, block_size=BS, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64))
    assert engine.kv_tiers is None and engine.kv.pool.on_evict is None
    now = serve(engine, "a", prompt(1, 3), 0.0)
    now = serve(engine, "b", prompt(2, 8), now)
    c = engine.add_request("c", now, 3 * BS + 2, 1, token_ids=prompt(1, 3) + (7, 7))
    assert engine.kv.lookup(c) == 0


def test_the_step_waits_only_for_what_has_not_arrived() -> None:
    def exposed(prefetch: int, arrival_s: float) -> float:
        tiers = KVTiers(tiers_config(host=8, ssd=8, prefetch=prefetch))
        tiers.host.update(dict.fromkeys((1, 2)))
        tiers.ssd[3] = None
        tiers.exposed_s(0.0)
        tiers.exposed_s(0.5)
        tiers.promote([1, 2, 3], arrival_s)
        return tiers.exposed_s(1.0)

    transfer = 1e-4 + 2 * 1e-3 + 1e-3 + 1 * 2e-3  # host: latency + 2 ms; SSD: latency + 2 ms
    assert exposed(0, 0.0) == pytest.approx(transfer)  # no lookahead: all of it
    assert exposed(1, 0.0) == 0.0  # issued at the previous step's start (0.5 s)
    assert exposed(1, 0.999) == pytest.approx(0.999 + transfer - 1.0)  # arrived just before: the rest
    assert exposed(2, 0.0) == 0.0


def test_transfers_queue_on_the_link() -> None:
    tiers = KVTiers(tiers_config(host=8, ssd=0, prefetch=0))
    tiers.host.update(dict.fromkeys(range(4)))
    tiers.promote([0, 1], 0.0)
    tiers.promote([2, 3], 0.0)
    assert tiers.exposed_s(0.0) == pytest.approx(2 * (1e-4 + 2e-3))  # the second waits for the first


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 2), st.integers(1, 3)), min_size=1, max_size=25),
    st.integers(0, 4), st.integers(0, 4),
)
def test_blocks_are_conserved_across_tiers(requests, host, ssd) -> None:
    """Random requests from a few prefix families, arriving over time on a small pool: after every
    step each block is in exactly one place (HBM index, host, SSD) within capacity, and every block
    evicted into the tiers is held, promoted or dropped (``check_invariants``); the run drains."""
    engine = tiered_engine(host, ssd, num_blocks=12)
    now, step = 0.0, 0
    pending = list(enumerate(requests))
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (family, blocks, _, output) = pending.pop(0)
            tokens = prompt(family, blocks) + (9,) * (i % 3)
            engine.add_request(f"r{i}", now, len(tokens), output, token_ids=tokens)
        step += 1
        plan = engine.schedule(now)
        now += 1.0
        engine.commit(plan, now)
        engine.check_invariants()
        assert step < 2000
    stats = engine.kv_stats()
    summary = engine.kv_tiers.summary(stats.prefix_query_tokens, stats.prefix_hit_tokens)
    assert min(summary["tokens"].values()) >= 0


def test_tiers_need_the_prefix_manager() -> None:
    with pytest.raises(ValueError, match="prefix"):
        EngineCore(EngineConfig(num_blocks=8, block_manager="paged", kv_tiers=tiers_config(4, 0)))
    with pytest.raises(ValueError, match="prefix"):
        EngineCore(EngineConfig(num_blocks=8, block_manager="contiguous", kv_tiers=tiers_config(4, 0)))


def test_resolve_sizes_the_tiers_from_the_device() -> None:
    device = load_device("ascend-910b3")
    assert device.host_memory_bytes > 0 and device.ssd_bandwidth > 0
    resolved = resolve(RunConfig(kv_offload_host_gb=4.0, kv_offload_ssd_gb=8.0, kv_prefetch_steps=2))
    tiers = resolved.engine_config.kv_tiers
    per_block = resolved.memory.bytes_per_block
    assert tiers.host.capacity_blocks == 4 * 2**30 // per_block and tiers.ssd.capacity_blocks == 8 * 2**30 // per_block
    assert tiers.host.bandwidth == device.host_link_bandwidth and tiers.ssd.bandwidth == device.ssd_bandwidth
    assert tiers.prefetch_steps == 2 and tiers.block_bytes == per_block
    assert resolve(RunConfig()).engine_config.kv_tiers is None


@pytest.mark.parametrize("args, field", [
    (["--kv-offload-host-gb", "4096"], "kv_offload_host_gb"),  # over the 128 GiB the device file states
    (["--kv-offload-host-gb", "-1"], "kv_offload_host_gb"),
    (["--kv-offload-ssd-gb", "-0.5"], "kv_offload_ssd_gb"),
    (["--kv-prefetch-steps", "-1"], "kv_prefetch_steps"),
    (["--kv-offload-host-gb", "1", "--block-manager", "paged"], "kv_offload_host_gb"),
])
def test_bad_tier_input_is_one_line_exit_2(args, field, tmp_path) -> None:
    result = CliRunner().invoke(main, ["simulate", "--quiet", "--max-requests", "5", "--device", "ascend-910b3",
                                       *args, "--out", str(tmp_path / "run")])
    output = result.output.strip()
    assert result.exit_code == 2, output
    assert len(output.splitlines()) == 1 and field in output and "Traceback" not in output
    assert not (tmp_path / "run").exists()


def test_simulate_reports_the_tiers_only_when_on(tmp_path) -> None:
    common = ["simulate", "--quiet", "--decisions", "off", "--trace", "mooncake_500", "--max-requests", "200",
              "--model", "qwen2.5-7b", "--device", "ascend-910b3", "--max-model-len", "32768"]
    runner = CliRunner()
    assert runner.invoke(main, [*common, "--out", str(tmp_path / "off")]).exit_code == 0
    result = runner.invoke(main, [*common, "--kv-offload-host-gb", "8", "--kv-offload-ssd-gb", "16", "--check",
                                  "--out", str(tmp_path / "on")])
    assert result.exit_code == 0, result.output
    off = json.loads((tmp_path / "off" / "summary.json").read_text())
    on = json.loads((tmp_path / "on" / "summary.json").read_text())
    assert "kv_tiers" not in off and "kv_tier_blocks" not in off["config"]["resolved"]
    tiers = on["kv_tiers"]
    assert tiers["tokens"]["host"] > 0 and tiers["tokens"]["ssd"] > 0
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"]
    assert tiers["bytes"]["hbm_to_host"] > 0 and tiers["bytes"]["host_to_hbm"] > 0
    assert on["config"]["resolved"]["kv_tier_blocks"]["host"] == tiers["host_capacity_blocks"]


def test_tier_keys_in_a_run_toml(tmp_path) -> None:
    from kvsim.sim.run.config import load_run_config

    path = tmp_path / "run.toml"
    path.write_text("kv_offload_host_gb = 16\nkv_offload_ssd_gb = 64.5\nkv_prefetch_steps = 3\n")
    config = load_run_config(path)
    assert (config.kv_offload_host_gb, config.kv_offload_ssd_gb, config.kv_prefetch_steps) == (16, 64.5, 3)
    path.write_text("kv_prefetch_steps = 1.5\n")
    with pytest.raises(ValueError, match="kv_prefetch_steps"):
        load_run_config(path)


def test_the_cluster_page_shows_each_instances_tier_traffic(tmp_path) -> None:
    args = ["simulate", "--trace", "mooncake_500", "--model", "qwen2.5-7b", "--max-model-len", "32768", "--instances", "2",
            "--kv-offload-host-gb", "8", "--num-blocks", "300", "--max-requests", "120", "--quiet", "--decisions", "off",
            "--out", str(tmp_path / "run")]
    assert CliRunner().invoke(main, args).exit_code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    moved = [s["kv_tiers"]["bytes"]["hbm_to_host"] for s in summary["instances"]]
    assert all(b > 0 for b in moved)  # small pools: both instances demoted prefix blocks
    page = CliRunner().invoke(main, ["report", "cluster", str(tmp_path / "run"), "--out", str(tmp_path / "page.html")])
    assert page.exit_code == 0, page.output
    html = (tmp_path / "page.html").read_text()
    assert "Prompt tokens by where their KV came from" in html
    assert f"{moved[0] / 1e9:.3f}" in html and f"{moved[1] / 1e9:.3f}" in html
