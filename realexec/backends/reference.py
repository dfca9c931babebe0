"""Dense, non-paged attention over packed sequences: the yardstick every paged backend is checked against.

It knows nothing of blocks, slots or kernels, and loops over sequences in float64, so a
disagreement with a backend points at the backend's paging, masking or GQA handling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of packed queries over packed whole contexts.

    ``query`` [sum(query_lens), H, D]; ``key``/``value`` [sum(seq_lens), Hkv, D] hold each
    sequence's full context (cached prefix, then the new tokens). Query ``i`` of sequence ``b``
    sits at position ``seq_lens[b] - query_lens[b] + i`` and attends to positions up to and
    including its own. Returns [sum(query_lens), H, Dv] in ``query.dtype`` (``Dv`` the values' size,
    which latent attention's up-projected values may have apart from the keys').
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"{len(query_lens)} query lengths but {len(seq_lens)} sequence lengths")
    if sum(query_lens) != query.shape[0] or sum(seq_lens) != key.shape[0]:
        raise ValueError(
            f"packed sizes disagree: query rows {query.shape[0]} vs sum(query_lens)={sum(query_lens)}, "
            f"key rows {key.shape[0]} vs sum(seq_lens)={sum(seq_lens)}"
        )
    group = num_heads // num_kv_heads
    out = query.new_empty(*query.shape[:2], value.shape[-1])
    q_start = kv_start = 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        if not 1 <= q_len <= s_len:
            raise ValueError(f"sequence {b}: need 1 <= query_len <= seq_len, got {q_len}, {s_len}")
        q = query[q_start : q_start + q_len].double()
        k = key[kv_start : kv_start + s_len].double().repeat_interleave(group, dim=1)
        v = value[kv_start : kv_start + s_len].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        query_pos = torch.arange(s_len - q_len, s_len, device=query.device)
        future = torch.arange(s_len, device=query.device)[None, :] > query_pos[:, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[q_start : q_start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        q_start += q_len
        kv_start += s_len
    return out
