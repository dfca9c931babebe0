"""The real P/D pair (realexec/pd_pair.py): the decode instance generates from the KV it was sent exactly what
dense greedy decoding of the whole request does; a replay of the pair's measured step and transfer times
reproduces both instances' decisions; the channel's link fit recovers a known link; bad pairs are refused."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from kvsim.cli.execute import REAL_DEFAULTS  # noqa: E402
from kvsim.cli.main import main  # noqa: E402
from kvsim.cli.validate import timed_steps  # noqa: E402
from kvsim.cli.validate_pair import pair_decisions  # noqa: E402
from kvsim.realexec.backends import get_backend  # noqa: E402
from kvsim.realexec.backends.cache_ops import allocate_caches  # noqa: E402
from kvsim.realexec.pd_pair import (  # noqa: E402
    DecodeWorker,
    PairChannel,
    PrefillExecutor,
    TransferTiming,
    bench_block_counts,
    block_bytes,
    fit_channel,
    fit_link,
    pack_blocks,
    unpack_blocks,
)
from kvsim.realexec.prompts import prompt_tokens  # noqa: E402
from kvsim.realexec.reference import greedy_gaps  # noqa: E402
from kvsim.sim.cluster.kv_transfer import RecordedMover  # noqa: E402
from kvsim.sim.cluster.runner import run_cluster  # noqa: E402
from kvsim.sim.perf.device import load_device  # noqa: E402
from kvsim.sim.perf.step_timer import ReplayTimer  # noqa: E402
from kvsim.sim.run.config import load_run_trace, resolve  # noqa: E402

PAIR = REAL_DEFAULTS.updated(model="tiny", max_requests=8, num_blocks=48, prefill_instances=1, decode_instances=1)


def test_blocks_packed_on_one_side_land_in_other_blocks_on_the_other():
    """Keys and values of different widths (MLA's latent and rope key), blocks in any order."""
    shape = dict(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_size=3, dtype=torch.float32, device="cpu",
                 value_head_size=5)
    source, target = allocate_caches(**shape), allocate_caches(**shape)
    for pair in source:
        for cache in pair:
            cache.copy_(torch.randn_like(cache))
    payload = pack_blocks(source, torch.tensor([5, 1, 6]))
    assert payload.dtype == torch.uint8 and len(payload) == 3 * block_bytes(source) == 3 * 2 * 4 * 2 * (3 + 5) * 4
    unpack_blocks(target, torch.tensor([0, 7, 2]), payload)
    for (sk, sv), (tk, tv) in zip(source, target):
        for s, t in ((sk, tk), (sv, tv)):
            assert torch.equal(t[0], s[5]) and torch.equal(t[7], s[1]) and torch.equal(t[2], s[6])
            assert not t[[1, 3, 4, 5, 6]].any()  # no other block written


def test_the_link_fit_recovers_a_known_latency_and_bandwidth_and_the_sets_distance_is_the_spread():
    latency, bandwidth = 8e-4, 2.5e9
    sizes = [b * 98304 for b in bench_block_counts(38)]
    assert bench_block_counts(38) == [1, 2, 4, 8, 16, 32, 38] and bench_block_counts(16) == [1, 2, 4, 8, 16]
    assert bench_block_counts(1) == [1]
    timings = [{"nbytes": n, "median_s": latency + n / bandwidth} for n in sizes]
    base = load_device("cpu").topology
    same = fit_channel({"before": timings, "after": timings}, base)
    assert same.topology.intra_latency_s == pytest.approx(latency, rel=1e-6)
    assert same.topology.intra_bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert same.topology.bandwidth_efficiency == 1.0 and same.topology.devices_per_node >= 2
    assert same.spread == pytest.approx(0.0, abs=1e-12) and [r["error"] for r in same.rows] == pytest.approx([0.0] * 2 * len(sizes))
    assert same.link.seconds(sizes[0]) == pytest.approx(timings[0]["median_s"])
    slower = fit_channel({"before": timings, "after": [{**t, "median_s": t["median_s"] * 1.2} for t in timings]}, base)
    assert slower.spread == pytest.approx(0.2)  # the machine moved a transfer 20 % over the run
    assert same.link.seconds(sizes[-1]) < slower.link.seconds(sizes[-1]) < 1.2 * same.link.seconds(sizes[-1])  # between the two
    assert {r["set"] for r in slower.rows} == {"before", "after"}
    with pytest.raises(ValueError, match="at least 2 sizes"):
        fit_link([TransferTiming(98304, 1e-3)] * 3, base)


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory):
    """The tiny model's pair on the demo trace's first rows, every plan checked; the tokens each side generated."""
    out = tmp_path_factory.mktemp("pair")
    resolved = resolve(PAIR)
    engine = resolved.engine_config
    sizing = dict(num_blocks=engine.num_blocks, block_size=engine.block_size, seed=PAIR.seed, check=True,
                  timing_repeats=1)  # the tokens are checked, not the times
    prefill = PrefillExecutor(resolved.model, get_backend("cpu"), **sizing)
    decode = DecodeWorker(resolved.model, **sizing)
    try:
        run, summary = run_cluster(resolved, load_run_trace(PAIR), out / "real", check=True, decisions="full",
                                   timers=[prefill, decode], mover=PairChannel(prefill, decode))
        decoded = {r.request_id: decode.call("tokens", r.request_id) for r in run.runs[1].requests}
    finally:
        decode.close()
    return out, resolved, run, summary, prefill, decoded


def test_the_decode_instance_generates_from_the_sent_kv_what_dense_greedy_decoding_does(pair_run):
    _, resolved, run, summary, prefill, decoded = pair_run
    assert summary["requests_completed"] == PAIR.max_requests and len(decoded) == len(run.transfers) >= 6
    hits = 0
    for request in run.runs[0].requests:
        if request.request_id not in decoded:
            continue
        generated = decoded[request.request_id]
        assert len(generated) == int(run.trace.output_tokens[request.trace_index])
        assert generated[0] == prefill.tokens(request.request_id)[0]  # the first token came with the KV
        prompt = prompt_tokens(request, resolved.model.vocab_size, PAIR.seed)
        assert max(greedy_gaps(prefill.model, prompt, generated)) == 0.0, request.request_id  # fp32 caches: no slack
        hits += request.prefix_hit_tokens > 0
    assert hits, "no prompt hit the prefill instance's prefix cache: the test would not cover shared blocks"


def test_a_transfer_moves_the_prompts_blocks_and_its_time_is_measured(pair_run):
    _, resolved, run, _, prefill, _ = pair_run
    for row, transfer in run.transfers.items():
        prompt = int(run.trace.prompt_tokens[row])
        assert transfer.nbytes == -(-prompt // PAIR.block_size) * block_bytes(prefill.kv_caches)
        assert transfer.nbytes == -(-prompt // PAIR.block_size) * resolved.memory.bytes_per_block  # the memory model's block
        # delay_s is arrived_s - prefill_end_s: with no queueing it is exposed_s up to that subtraction's rounding
        assert transfer.wire_s == transfer.exposed_s > 0 and transfer.delay_s >= transfer.exposed_s * (1 - 1e-12)


def test_replaying_the_pairs_measured_times_reproduces_both_instances_decisions(pair_run):
    out, resolved, run, _, _, _ = pair_run
    timers = [ReplayTimer(timed_steps(one)) for one in run.runs]
    mover = RecordedMover({row: t.wire_s for row, t in run.transfers.items()})
    run_cluster(resolved, load_run_trace(PAIR), out / "replay", decisions="full", timers=timers, mover=mover)
    assert pair_decisions(out / "real", out / "replay", 2)["identical"]
    # a transfer replayed slower moves the decode instance's steps: the comparison can fail
    slower = RecordedMover({row: t.wire_s * 50 for row, t in run.transfers.items()})
    timers = [ReplayTimer(timed_steps(one) * 2) for one in run.runs]
    run_cluster(resolved, load_run_trace(PAIR), out / "slower", decisions="full", timers=timers, mover=slower)
    differs = pair_decisions(out / "real", out / "slower", 2)
    assert not differs["identical"]


@pytest.mark.parametrize("args, named", [
    (["--prefill-instances", "2", "--decode-instances", "1"], "--prefill-instances 2"),
    (["--kv-connector", "layerwise"], "--kv-connector layerwise"),
    (["--decode-tensor-parallel-size", "2"], "--decode-tensor-parallel-size"),
    (["--backend", "cuda"], "--backend cuda"),
])
def test_a_pair_the_real_executor_does_not_run_is_refused_in_one_line(args, named, tmp_path):
    pair = ["--prefill-instances", "1", "--decode-instances", "1"]
    result = CliRunner().invoke(main, ["execute", "--model", "tiny", *pair, *args, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2, result.output
    assert named in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_cluster_is_refused_by_the_real_executor(tmp_path):
    result = CliRunner().invoke(main, ["execute", "--model", "tiny", "--instances", "2", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--instances" in result.output and len(result.output.strip().splitlines()) == 1


def test_validate_compares_the_pair_with_its_simulation_and_judges_it(tmp_path, monkeypatch):
    """The command end to end on the tiny model (no threshold asserted: a loaded CI machine measures noise)."""
    pytest.importorskip("plotly")
    from kvsim.sim.perf.device import DEVICES_DIR

    monkeypatch.setenv("KVSIM_CPU_TIMING_REPEATS", "3")
    out = tmp_path / "v"
    result = CliRunner().invoke(main, ["validate", "--model", "tiny", "--prefill-instances", "1", "--decode-instances", "1",
                                       "--max-requests", "8", "--num-blocks", "48", "--profile", str(DEVICES_DIR / "cpu.toml"),
                                       "--retime-passes", "1", "--out", str(out)])
    assert result.exit_code in (0, 1, 3), result.output
    validation = json.loads((out / "validation.json").read_text())
    assert validation["decision_identity"]["identical"] and validation["decision_identity"]["steps_compared"] > 20
    checks = {c["name"]: c for c in validation["checks"]}
    transfer = checks["kv_transfer_rel_error"]
    assert transfer["threshold"] == 0.10 and transfer["value"] == pytest.approx(abs(validation["transfers"]["in_run"]["median_ratio"] - 1))
    assert validation["transfers"]["in_run"]["transfers"] >= 6 and validation["transfers"]["channel_spread"] is not None
    assert validation["repeatability"]["spread"]["kv_transfer_rel_error"] == validation["transfers"]["channel_spread"]
    assert {row["set"] for row in validation["transfers"]["channel"]} == {"before", "after"}
    series = validation["series"]["step_time"]
    assert set(series["instance"]) == {0, 1} and len(series["measured"]) == len(series["predicted"]) == len(series["instance"])
    assert validation["verdict"]["outcome"] in ("pass", "fail", "inconclusive")
    assert "KV transfers: " in result.output and "decision logs: identical" in result.output
    assert (out / "report.html").exists() and (out / "profile-for-pair.toml").exists()
    assert load_device(out / "profile-for-pair.toml").topology.intra_latency_s == validation["transfers"]["link"]["latency_s"]
