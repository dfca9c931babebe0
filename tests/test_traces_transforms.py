"""Transforms: each keeps the schema valid, does exactly its job, and notes it."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim import traces
from kvsim.traces import Ragged, Trace


def small(block: int = 4) -> Trace:
    """Six requests at 0, 1, ..., 5 s with chained hashes; requests 2 and 4 share a prompt."""
    prompt = np.array([8, 5, 11, 4, 11, 1], dtype=np.int64)
    hashes = [[1, 2], [1, 3], [1, 2, 4], [5], [1, 2, 4], [7]]
    return Trace(
        arrival_s=np.arange(6, dtype=np.float64),
        prompt_tokens=prompt,
        output_tokens=np.array([3, 6, 2, 9, 1, 4], dtype=np.int64),
        source="small",
        prefix_hashes=Ragged.from_rows(hashes),
        hash_block_size=block,
        session_id=np.array([0, 1, 0, 2, 0, 3], dtype=np.int64),
    )


def test_scale_rate() -> None:
    t = traces.scale_rate(small(), 4.0)
    assert t.arrival_s.tolist() == [0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert t.prompt_tokens.tolist() == small().prompt_tokens.tolist()
    assert t.notes == ("rate scaled by 4",)
    with pytest.raises(ValueError):
        traces.scale_rate(small(), 0)


def test_window_is_half_open_and_retimed() -> None:
    t = traces.window(small(), 1.5, 4.0)
    t.validate()
    assert t.arrival_s.tolist() == [0.0, 1.0]
    assert t.prompt_tokens.tolist() == [11, 4]
    assert t.prefix_hashes.to_rows() == [[1, 2, 4], [5]]
    assert t.session_id.tolist() == [0, 2]
    assert t.notes == ("window [1.5, 4) s: 2 of 6 requests",)
    assert len(traces.window(small(), 0, np.inf)) == 6
    with pytest.raises(ValueError, match="no requests left"):
        traces.window(small(), 10, 20)


def test_first_and_sample() -> None:
    assert traces.first(small(), 2).prompt_tokens.tolist() == [8, 5]
    assert len(traces.first(small(), 100)) == 6
    a = traces.sample(small(), 3, seed=1)
    a.validate()
    assert a.equals(traces.sample(small(), 3, seed=1))
    original = small().prefix_hashes.to_rows()
    picked = [small().output_tokens.tolist().index(o) for o in a.output_tokens.tolist()]  # outputs are unique
    assert picked == sorted(picked) and len(set(picked)) == 3
    assert a.prefix_hashes.to_rows() == [original[i] for i in picked]
    assert a.arrival_s[0] == 0.0 and a.arrival_s.tolist() == [float(i - picked[0]) for i in picked]
    seeds = {tuple(traces.sample(small(), 3, seed=s).output_tokens.tolist()) for s in range(10)}
    assert len(seeds) > 1
    with pytest.raises(ValueError):
        traces.sample(small(), 7)


def test_clamp_fits_the_context_and_cuts_hashes_consistently() -> None:
    t = traces.clamp(small(), 10)
    t.validate()
    assert np.all(t.prompt_tokens + t.output_tokens <= 10) and np.all(t.output_tokens >= 1)
    assert t.prompt_tokens.tolist() == [8, 5, 9, 4, 9, 1]
    assert t.output_tokens.tolist() == [2, 5, 1, 6, 1, 4]
    rows = t.prefix_hashes.to_rows()
    assert rows[0] == [1, 2] and rows[1] == [1, 3]  # prompts unchanged keep their hashes
    # requests 2 and 4 both cut block [1, 2, 4] to 1 token: the same fresh id, new to the trace
    assert rows[2] == rows[4] and rows[2][:2] == [1, 2] and rows[2][2] not in {1, 2, 3, 4, 5, 7}
    assert t.notes[-1] == "clamped to max_model_len 10: 5 requests shortened"


def test_clamp_on_a_block_boundary_keeps_ids() -> None:
    t = traces.clamp(small(), max_prompt=8)
    assert t.prefix_hashes.to_rows()[2] == [1, 2]  # 11 -> 8 tokens: two full original blocks
    assert t.prefix_hashes.to_rows()[4] == [1, 2]


def test_clamp_caps_outputs_and_token_ids() -> None:
    base = small()
    with_tokens = Trace(base.arrival_s, base.prompt_tokens, base.output_tokens,
                        token_ids=Ragged.from_rows([list(range(p)) for p in base.prompt_tokens.tolist()]))
    t = traces.clamp(with_tokens, max_prompt=3, max_output=2)
    t.validate()
    assert t.output_tokens.tolist() == [2, 2, 2, 2, 1, 2]
    assert t.token_ids.to_rows()[0] == [0, 1, 2]
    with pytest.raises(ValueError):
        traces.clamp(base, 1)


def test_shrink_lengths_keeps_the_block_structure() -> None:
    t = traces.load(traces.bundled("mooncake_500"))
    s = traces.shrink_lengths(t, 16)
    s.validate()
    assert s.hash_block_size == 32
    assert s.prefix_hashes.equals(t.prefix_hashes)
    assert s.prompt_tokens.tolist() == [-(-p // 16) for p in t.prompt_tokens.tolist()]
    assert traces.prefix_reuse_bound(s) == pytest.approx(traces.prefix_reuse_bound(t), abs=0.01)
    with pytest.raises(ValueError, match="does not divide"):
        traces.shrink_lengths(t, 3)


def test_spread_buckets_spreads_each_grid_bucket_evenly() -> None:
    grid = Trace(np.array([0.0, 0, 0, 3, 3, 9]), np.ones(6, dtype=np.int64), np.ones(6, dtype=np.int64))
    t = traces.spread_buckets(grid)  # width: the median gap between distinct timestamps, 4.5 s
    t.validate()
    assert t.arrival_s.tolist() == [0.0, 1.0, 2.0, 3.0, 3.0 + 4.5 / 2, 9.0]  # never past the next bucket
    assert t.notes == ("timestamp buckets spread over 4.5 s",)
    assert traces.spread_buckets(grid, width_s=1.0).arrival_s.tolist() == [0.0, 1 / 3, 2 / 3, 3.0, 3.5, 9.0]
    assert traces.spread_buckets(grid).equals(t)
    with pytest.raises(ValueError, match="single timestamp"):
        traces.spread_buckets(Trace(np.zeros(3), np.ones(3, dtype=np.int64), np.ones(3, dtype=np.int64)))


def test_spread_buckets_on_mooncake_keeps_order_and_grid() -> None:
    t = traces.load(traces.bundled("mooncake_500"))
    s = traces.spread_buckets(t)
    assert np.all(np.diff(s.arrival_s) > 0)
    assert np.all(s.arrival_s >= t.arrival_s) and np.all(s.arrival_s < t.arrival_s + 3.0)
    assert np.array_equal(s.prompt_tokens, t.prompt_tokens)


def test_take_rejects_unsorted_indices() -> None:
    with pytest.raises(ValueError, match="ascending"):
        traces.take(small(), np.array([2, 1]))
