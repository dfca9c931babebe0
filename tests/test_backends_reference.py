"""The dense attention reference, checked against torch's SDPA and against its own chunking property."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from kvsim.realexec.backends.reference import dense_attention  # noqa: E402


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_full_prefill_equals_causal_sdpa(num_heads: int, num_kv_heads: int) -> None:
    s, d = 37, 16
    q, k, v = _rand(s, num_heads, d, seed=1), _rand(s, num_kv_heads, d, seed=2), _rand(s, num_kv_heads, d, seed=3)
    group = num_heads // num_kv_heads
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
        scale=0.3,
    ).transpose(0, 1)
    torch.testing.assert_close(dense_attention(q, k, v, [s], [s], 0.3), expected, atol=1e-5, rtol=1e-5)


def test_a_chunk_equals_the_same_rows_of_a_full_prefill() -> None:
    """Queries at the end of a context see what the same positions see in a full causal pass."""
    s, d = 50, 8
    q, k, v = _rand(s, 4, d, seed=4), _rand(s, 2, d, seed=5), _rand(s, 2, d, seed=6)
    full = dense_attention(q, k, v, [s], [s], 0.5)
    for q_len in (1, 7, 50):
        chunk = dense_attention(q[s - q_len :], k, v, [q_len], [s], 0.5)
        torch.testing.assert_close(chunk, full[s - q_len :], atol=1e-6, rtol=1e-6)


def test_packed_sequences_do_not_see_each_other() -> None:
    q, k, v = _rand(3, 2, 8, seed=7), _rand(10, 2, 8, seed=8), _rand(10, 2, 8, seed=9)
    both = dense_attention(q, k, v, [1, 2], [4, 6], 0.25)
    torch.testing.assert_close(both[:1], dense_attention(q[:1], k[:4], v[:4], [1], [4], 0.25))
    torch.testing.assert_close(both[1:], dense_attention(q[1:], k[4:], v[4:], [2], [6], 0.25))


def test_decode_query_attends_its_whole_context() -> None:
    q, k, v = _rand(1, 2, 8, seed=10), _rand(9, 2, 8, seed=11), _rand(9, 2, 8, seed=12)
    probs = torch.softmax(torch.einsum("hd,khd->hk", q[0], k) * 0.5, dim=-1)
    torch.testing.assert_close(dense_attention(q, k, v, [1], [9], 0.5)[0], torch.einsum("hk,khd->hd", probs, v))


@pytest.mark.parametrize(
    "query_lens,seq_lens,shapes,match",
    [
        ([2], [1], ((2, 2, 4), (1, 2, 4)), "query_len <= seq_len"),
        ([1, 1], [3], ((2, 2, 4), (3, 2, 4)), "2 query lengths but 1"),
        ([1], [3], ((2, 2, 4), (3, 2, 4)), "packed sizes disagree"),
        ([1], [3], ((1, 3, 4), (3, 2, 4)), "not a multiple"),
    ],
)
def test_inconsistent_inputs_are_rejected(query_lens, seq_lens, shapes, match) -> None:
    (qs, ks) = shapes
    with pytest.raises(ValueError, match=match):
        dense_attention(torch.zeros(qs), torch.zeros(ks), torch.zeros(ks), query_lens, seq_lens, 1.0)
