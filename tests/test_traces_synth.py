"""Generators: seeded determinism, statistical sanity, shared prompts and conversation chaining."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim import traces
from kvsim.traces import Empirical, Fixed, LogNormal, Uniform


def cv(x: np.ndarray) -> float:
    return float(x.std() / x.mean())


def test_poisson_arrivals_rate_cv_and_determinism() -> None:
    a = traces.poisson_arrivals(5.0, n=20_000, rng=3)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0) and len(a) == 20_000
    gaps = np.diff(a)
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.03)
    assert cv(gaps) == pytest.approx(1.0, abs=0.03)
    assert np.array_equal(a, traces.poisson_arrivals(5.0, n=20_000, rng=3))
    assert not np.array_equal(a, traces.poisson_arrivals(5.0, n=20_000, rng=4))


@pytest.mark.parametrize("target_cv", [0.5, 3.0])
def test_gamma_arrivals_hit_the_requested_cv(target_cv: float) -> None:
    gaps = np.diff(traces.gamma_arrivals(2.0, target_cv, n=50_000, rng=1))
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.05)
    assert cv(gaps) == pytest.approx(target_cv, rel=0.08)


def test_arrivals_over_a_duration() -> None:
    a = traces.gamma_arrivals(10.0, 2.0, duration_s=500.0, rng=0)
    assert a.max() < 500.0 and a[0] == 0.0
    assert len(a) == pytest.approx(5000, rel=0.1)
    with pytest.raises(ValueError, match="exactly one"):
        traces.poisson_arrivals(1.0, n=3, duration_s=3.0)
    with pytest.raises(ValueError, match="rate"):
        traces.poisson_arrivals(0.0, n=3)


def test_length_distributions() -> None:
    rng = np.random.default_rng(0)
    assert Fixed(7).sample(rng, 4).tolist() == [7, 7, 7, 7]
    u = Uniform(3, 5).sample(rng, 30_000)
    assert set(u.tolist()) == {3, 4, 5} and u.mean() == pytest.approx(4.0, abs=0.03)
    ln = LogNormal(1000, 1.5).sample(rng, 400_000)
    assert ln.min() >= 1 and ln.dtype == np.int64
    assert ln.mean() == pytest.approx(1000, rel=0.02)
    assert cv(ln.astype(float)) == pytest.approx(1.5, rel=0.1)
    emp = Empirical(np.array([10, 20, 20, 40])).sample(rng, 40_000)
    assert set(emp.tolist()) == {10, 20, 40}
    assert np.mean(emp == 20) == pytest.approx(0.5, abs=0.015)
    for bad in (lambda: Fixed(0), lambda: Uniform(5, 3), lambda: LogNormal(0.5, 1), lambda: Empirical(np.array([0]))):
        with pytest.raises(ValueError):
            bad()


def test_parse_length_specs(tmp_path) -> None:
    assert traces.parse_length("fixed:512") == Fixed(512)
    assert traces.parse_length("uniform:10,20") == Uniform(10, 20)
    assert traces.parse_length("lognormal:800,1.2") == LogNormal(800, 1.2)
    emp = traces.parse_length("empirical:mooncake_500", "output_tokens")
    assert np.array_equal(emp.values, traces.load(traces.bundled("mooncake_500")).output_tokens)
    for bad in ("fixed:1.5", "uniform:3", "normal:3,4", "fixed:0", "empirical:"):
        with pytest.raises(ValueError, match="bad length spec"):
            traces.parse_length(bad)


def test_synthesize_is_fixed_by_parameters_and_seed() -> None:
    kwargs = dict(rate=4.0, n_requests=300, arrival_cv=2.0, prompt=LogNormal(500, 1.0), output=Uniform(1, 99),
                  system_prompt_tokens=100, turns=2, think_time_s=3.0, n_samples=3)
    a, b = traces.synthesize(seed=5, **kwargs), traces.synthesize(seed=5, **kwargs)
    assert a.equals(b)
    assert not a.equals(traces.synthesize(seed=6, **kwargs))
    a.validate()
    assert len(a) == 300 and a.n_samples.tolist() == [3] * 300
    assert "gamma cv=2" in a.source and "seed=5" in a.source


def test_single_turn_without_shared_prompt_has_no_hashes_and_the_right_rate() -> None:
    t = traces.synthesize(rate=8.0, duration_s=1000.0, prompt=Fixed(100), output=Fixed(10), seed=1)
    assert t.prefix_hashes is None and t.session_id is None and t.n_samples is None
    s = traces.stats(t)
    assert s.rate_rps == pytest.approx(8.0, rel=0.05)
    assert s.interarrival_cv == pytest.approx(1.0, abs=0.05)
    assert t.arrival_s[-1] < 1000.0


def test_system_prompt_blocks_are_shared_by_everyone() -> None:
    n, block, system = 50, 16, 70  # 4 full shared blocks, then user tokens
    t = traces.synthesize(rate=1.0, n_requests=n, prompt=Fixed(30), system_prompt_tokens=system, hash_block_size=block, seed=2)
    rows = t.prefix_hashes.to_rows()
    assert all(r[:4] == rows[0][:4] for r in rows)
    assert len({r[4] for r in rows}) == n  # the partial block mixes in each user's own tokens
    # every request after the first reuses exactly the 4 full system blocks
    assert traces.prefix_reuse_bound(t) == pytest.approx((n - 1) * 4 * block / (n * (system + 30)))


def test_conversation_turns_chain_their_hashes() -> None:
    block = 16
    t = traces.synthesize(rate=2.0, n_requests=600, prompt=LogNormal(90, 0.8), output=LogNormal(40, 0.8),
                          system_prompt_tokens=40, turns=4, think_time_s=5.0, hash_block_size=block, seed=11)
    t.validate()
    by_session: dict[int, list[int]] = {}
    for i, s in enumerate(t.session_id.tolist()):
        by_session.setdefault(s, []).append(i)
    rows = t.prefix_hashes.to_rows()
    chained = 0
    for members in by_session.values():
        for k, nxt in zip(members, members[1:]):
            history = int(t.prompt_tokens[k] + t.output_tokens[k])
            assert t.prompt_tokens[nxt] > history  # new user tokens follow the answer
            full = history // block
            for later in members[members.index(nxt):]:  # every later turn starts with them
                assert rows[later][:full] == rows[nxt][:full]
            assert rows[nxt][: t.prompt_tokens[k] // block] == rows[k][: t.prompt_tokens[k] // block]
            chained += 1
    assert chained > 300
    # different conversations share only the system prompt's 2 full blocks
    firsts = [rows[m[0]] for m in by_session.values()]
    assert {tuple(r[:2]) for r in firsts} == {tuple(rows[0][:2])}
    assert len({r[2] for r in firsts}) == len(firsts)


def test_two_turn_reuse_bound_matches_hand_count() -> None:
    # prompt 100 (6 full blocks), answer 50: turn 2 is 250 tokens and reuses turn 1's 6 full
    # prompt blocks when turn 1 is in the trace (a conversation begun before the window is
    # not); the blocks that the answer completed were never sent, so they miss
    t = traces.synthesize(rate=1.0, n_requests=40, prompt=Fixed(100), output=Fixed(50), turns=2, think_time_s=1.0,
                          hash_block_size=16, seed=3)
    firsts, seconds = np.sum(t.prompt_tokens == 100), np.sum(t.prompt_tokens == 250)
    sessions, counts = np.unique(t.session_id, return_counts=True)
    both = int(np.sum(counts == 2))  # conversations with both turns inside
    assert firsts + seconds == 40 and both > 10
    assert traces.prefix_reuse_bound(t) == pytest.approx(both * 96 / (firsts * 100 + seconds * 250))


def test_conversations_realise_the_asked_request_rate() -> None:
    # `kvsim trace synth --rate 5 --duration 600 --turns 3` once gave 4.58 req/s
    made = [traces.synthesize(rate=5.0, duration_s=600.0, turns=3, seed=seed) for seed in range(20)]
    assert np.mean([len(t) / 600.0 for t in made]) == pytest.approx(5.0, rel=0.02)
    arrivals = np.concatenate([t.arrival_s for t in made])
    first, middle, last = (np.sum((arrivals >= a) & (arrivals < a + 100)) for a in (0, 250, 500))
    assert first == pytest.approx(middle, rel=0.06) and last == pytest.approx(middle, rel=0.06)  # no ramp up or down
    counted = traces.synthesize(rate=5.0, n_requests=3000, turns=3, seed=1)
    assert len(counted) / counted.arrival_s[-1] == pytest.approx(5.0, rel=0.05)


def test_synthesize_duration_keeps_arrivals_inside() -> None:
    t = traces.synthesize(rate=5.0, duration_s=2000.0, turns=3, think_time_s=20.0, system_prompt_tokens=32, seed=0)
    assert t.arrival_s[-1] < 2000.0 and len(t) == pytest.approx(10_000, rel=0.05)
    with pytest.raises(ValueError, match="exactly one"):
        traces.synthesize(rate=1.0)
