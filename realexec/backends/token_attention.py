"""Paged attention addressed per query token, with every shape fixed by the batch's token count.

The portable path (``portable.py``) plans padded batches from the step's host lists, so its
kernels' shapes change from step to step; a captured graph cannot replay that. Here each query
token carries its sequence's row of the block table and its own position, both on the device,
and attends to positions ``[0, position]`` of that row: one formulation for prefill, chunked
prefill, decode and mixed batches whose launch shapes depend only on the token count and the
table's width. The cuda backend runs it as a Triton kernel (``triton_attention.py``) that reads
only the blocks a token can see; :func:`token_paged_attention` below is the same computation in
plain PyTorch (it gathers the whole table row, so its cost follows the table's width): the
reference the kernel is tested against, and the path graph tests take on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsim.realexec.backends.base import AttentionMetadata
from kvsim.realexec.backends.kv_quant import KVScales, dequantize, require_scales

TOKENS_KEY = "token_attention.tokens"  # AttentionMetadata.memo key of a step's TokenMetadata


@dataclass(frozen=True)
class TokenMetadata:
    """Per query token, on the device: its sequence's row in ``block_tables`` and its position."""

    token_seq: torch.Tensor  # int32 [T]: row of block_tables
    positions: torch.Tensor  # int32 [T]: the token's position; it sees cache positions [0, position]
    block_tables: torch.Tensor  # int32 [B, W]: blocks of each sequence, in order (padding never read)
    # int32 [1] or None: tokens from this index on pad a captured graph's batch; they attend to nothing
    # (output zeros), as vLLM's kernels skip padded rows: the Triton kernel reads no block for them
    num_real: torch.Tensor | None = None

    @classmethod
    def from_meta(cls, meta: AttentionMetadata) -> TokenMetadata:
        """Derived from a step's host lists: sequence ``b``'s new tokens sit at its last ``query_len`` positions."""
        token_seq: list[int] = []
        positions: list[int] = []
        for b, (q, s) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            token_seq += [b] * q
            positions += range(s - q, s)
        device = meta.block_tables.device
        return cls(
            token_seq=torch.tensor(token_seq, dtype=torch.int32).to(device),
            positions=torch.tensor(positions, dtype=torch.int32).to(device),
            block_tables=meta.block_tables.to(torch.int32),
        )

    @classmethod
    def of_step(cls, meta: AttentionMetadata) -> TokenMetadata:
        """The step's token metadata, derived once for all layers (a captured graph pre-sets its static one)."""
        return meta.memo(TOKENS_KEY, lambda: cls.from_meta(meta))


def token_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tokens: TokenMetadata,
    scale: float,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query`` [T, H, D]: token ``t`` attends to its row's positions ``<= positions[t]``.

    Gathers the whole table row of every token ([T, Hkv, W * block_size, D]): shapes depend only
    on T and W, so it can be captured in a graph, at a cost that follows W rather than the context.
    """
    num_tokens, num_heads, head_size = query.shape
    num_blocks_row, block_size, num_kv_heads = tokens.block_tables.shape[1], key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    quant = require_scales(key_cache, kv_scales)
    rows = tokens.block_tables.long().index_select(0, tokens.token_seq.long())  # [T, W]

    def gather(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        blocks = cache.index_select(0, rows.reshape(-1)).view(num_tokens, num_blocks_row * block_size, num_kv_heads, head_size)
        blocks = blocks.transpose(1, 2)  # [T, Hkv, L, D]
        return blocks.to(query.dtype) if scales is None else dequantize(blocks, scales[:, None], query.dtype)

    k = gather(key_cache, None if quant is None else quant.key)
    v = gather(value_cache, None if quant is None else quant.value)
    visible = torch.arange(num_blocks_row * block_size, device=query.device)[None, :] <= tokens.positions.long()[:, None]
    q = query.view(num_tokens, num_kv_heads, group, head_size)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    if tokens.num_real is not None:  # padding rows: zeros, as the Triton kernel leaves them
        out = out * (torch.arange(num_tokens, device=query.device) < tokens.num_real)[:, None, None, None]
    return out.reshape(num_tokens, num_heads, head_size)
