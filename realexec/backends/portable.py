"""Paged KV in portable PyTorch: the cpu backend's kernels and the cuda backend's fallback.

Attention gathers each sequence's blocks into a padded batch and runs one masked
``scaled_dot_product_attention`` per batch: no Python loop over tokens or sequences. Two things
keep the padding cheap:

- decode sequences (one query token) and prefill/chunked sequences go to separate SDPA calls, so
  a 512-token prefill does not pad 31 decode queries to 512 rows each;
- grouped-query heads are folded into the query-row axis (``[B, Hkv, q*G, D]`` against
  ``[B, Hkv, L, D]``), so K and V are never repeated per query head;
- long queries are cut into tiles of ``QUERY_TILE`` tokens, each attending only to the context
  its last token can see, which skips most of the masked upper triangle of a fresh prefill
  (SDPA's CPU kernel computes masked-out scores too).

The index tensors and masks depend only on the step's metadata, so they are derived once per
step (``AttentionMetadata.memo``) and reused by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsim.policies.blocks import cdiv, slot
from kvsim.realexec.backends.base import AttentionMetadata, KernelBackend
from kvsim.realexec.backends.cache_ops import KVCaches, allocate_caches, copy_blocks
from kvsim.realexec.backends.kv_quant import KVScales, dequantize, quantize, require_scales
from kvsim.realexec.backends.token_attention import TokenMetadata, token_paged_attention
from kvsim.realexec.model import MoeWeights, routed_experts

QUERY_TILE = 128  # query tokens per SDPA call within a prefill batch
DECODE_BUCKETS = 4  # decode sequences are split into at most this many batches by context length
MIN_DECODE_BUCKET = 8  # ... of at least this many sequences each


@dataclass(frozen=True)
class QueryTile:
    """Query slots [start, end) of a padded batch, which see at most the first ``kv_len`` context positions."""

    start: int
    end: int
    kv_len: int
    mask: torch.Tensor  # bool [B, 1, (end - start) * group, kv_len]: True = may attend


@dataclass(frozen=True)
class PaddedBatch:
    """Sequences attended together, padded to common query and context lengths."""

    query_rows: torch.Tensor  # long [B * max_q]: the query row each padded slot reads (padding repeats the last)
    out_rows: torch.Tensor  # long [n]: output rows of the real slots, in slot order
    real: torch.Tensor | None  # long [n]: the real slots, in order; None when none is padding
    block_table: torch.Tensor  # long [B, max_blocks]: each sequence's blocks, trimmed to the longest
    tiles: list[QueryTile]
    max_q: int


def plan_padded_batches(meta: AttentionMetadata, group: int) -> list[PaddedBatch]:
    """Decode sequences in up to ``DECODE_BUCKETS`` batches of similar context length, then the prefills."""
    decode = sorted((b for b, q in enumerate(meta.query_lens_list) if q == 1), key=lambda b: meta.seq_lens_list[b])
    prefill = [b for b, q in enumerate(meta.query_lens_list) if q > 1]
    buckets = min(DECODE_BUCKETS, math.ceil(len(decode) / MIN_DECODE_BUCKET))
    batches = [decode[i * len(decode) // buckets : (i + 1) * len(decode) // buckets] for i in range(buckets)]
    return [_padded_batch(meta, seqs, group) for seqs in (*batches, prefill) if seqs]


def _padded_batch(meta: AttentionMetadata, seqs: list[int], group: int) -> PaddedBatch:
    device = meta.block_tables.device
    q_host = [meta.query_lens_list[b] for b in seqs]
    s_host = [meta.seq_lens_list[b] for b in seqs]
    max_q = max(q_host)
    max_blocks = cdiv(max(s_host), meta.block_size)
    ids = torch.tensor(seqs, dtype=torch.long, device=device)
    q_lens = torch.tensor(q_host, dtype=torch.long, device=device)
    s_lens = torch.tensor(s_host, dtype=torch.long, device=device)

    slot = torch.arange(max_q, device=device)
    clamped = torch.minimum(slot[None, :], q_lens[:, None] - 1)  # padding slots repeat the last query
    query_rows = (meta.query_start_loc[ids].long()[:, None] + clamped).reshape(-1)
    # Query i of a sequence sits at position (seq_len - q_len + i) and sees everything up to it.
    own_pos = (s_lens - q_lens)[:, None] + clamped  # [B, max_q]
    kv_pos = torch.arange(max_blocks * meta.block_size, device=device)
    mask = (kv_pos[None, None, :] <= own_pos[:, :, None]).repeat_interleave(group, dim=1).unsqueeze(1)
    tiles = []
    for start in range(0, max_q, QUERY_TILE):
        end = min(start + QUERY_TILE, max_q)
        kv_len = max(s - q + min(end, q) for q, s in zip(q_host, s_host))  # the furthest any slot here sees, + 1
        tiles.append(QueryTile(start, end, kv_len, mask[:, :, start * group : end * group, :kv_len].contiguous()))
    if all(q == max_q for q in q_host):
        real, out_rows = None, query_rows
    else:
        real = torch.nonzero((slot[None, :] < q_lens[:, None]).reshape(-1)).squeeze(1)
        out_rows = query_rows.index_select(0, real)
    return PaddedBatch(
        query_rows=query_rows,
        out_rows=out_rows,
        real=real,
        block_table=meta.block_tables[ids, :max_blocks].long(),
        tiles=tiles,
        max_q=max_q,
    )


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, max_blocks * block_size, D] (a strided view) of the blocks in ``block_table`` [B, max_blocks].

    Whole blocks are copied with ``index_select`` (one contiguous ``block_size * Hkv * D`` memcpy
    each; advanced indexing measured 3-12x slower on CPU) and the head axis is only transposed
    in the view: SDPA reads the strided rows directly, which measured faster than making them
    contiguous or gathering per head.
    """
    batch = block_table.shape[0]
    blocks = cache.index_select(0, block_table.reshape(-1))
    return blocks.view(batch, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    compute_dtype: torch.dtype | None = None,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """Causal paged attention of packed ``query`` [T, H, D] over the caches, by padded SDPA batches.

    An int8 cache is dequantised block by block as it is gathered (the C8 reference every backend
    is compared with).
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    dtype = compute_dtype or query.dtype
    quant = require_scales(key_cache, kv_scales)
    out = torch.empty_like(query)
    for batch in meta.memo(f"portable.padded_batches.g{group}", lambda: plan_padded_batches(meta, group)):
        nseq = batch.block_table.shape[0]
        q = query.index_select(0, batch.query_rows).view(nseq, batch.max_q, num_kv_heads, group, head_size)
        q = q.permute(0, 2, 1, 3, 4).reshape(nseq, num_kv_heads, batch.max_q * group, head_size)
        k, v = gather_blocks(key_cache, batch.block_table), gather_blocks(value_cache, batch.block_table)
        if quant is None:
            k, v = k.to(dtype), v.to(dtype)
        else:  # scales [Hkv, D] against blocks [B, Hkv, L, D]
            k, v = dequantize(k, quant.key[:, None], dtype), dequantize(v, quant.value[:, None], dtype)
        o = _attend_tiles(q.to(dtype), k, v, batch.tiles, group, scale)
        o = o.view(nseq, num_kv_heads, batch.max_q, group, head_size).permute(0, 2, 1, 3, 4)
        o = o.reshape(nseq * batch.max_q, num_heads, head_size)
        out.index_copy_(0, batch.out_rows, (o if batch.real is None else o.index_select(0, batch.real)).to(query.dtype))
    return out


def paged_latent_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
) -> torch.Tensor:
    """MLA over the paged latents (``KernelBackend.mla_attention``), by the same padded batches as
    :func:`paged_attention`: a decode batch absorbs the up-projection (one latent "head" that all
    query heads attend with, so the latents are read once per sequence), a prefill batch up-projects
    the latents it gathered to per-head K and V and attends tile by tile."""
    num_tokens, num_heads, _ = query.shape
    nope, v_dim = w_uk.shape[1], w_uv.shape[1]
    w_uk, w_uv = w_uk.to(query.dtype), w_uv.to(query.dtype)
    out = query.new_empty(num_tokens, num_heads, v_dim)
    for batch in meta.memo("portable.padded_batches.g1", lambda: plan_padded_batches(meta, 1)):
        nseq = batch.block_table.shape[0]
        q = query.index_select(0, batch.query_rows).view(nseq, batch.max_q, num_heads, -1)
        latent = gather_blocks(latent_cache, batch.block_table).to(query.dtype)  # [B, 1, L, kv_lora_rank]
        rope = gather_blocks(rope_cache, batch.block_table).to(query.dtype)  # [B, 1, L, rope]
        if batch.max_q == 1:  # absorbed: q_nope @ W_UK into latent space, attend over [latent, rope], @ W_UV
            tile = batch.tiles[0]
            q_latent = torch.einsum("bhn,hnl->bhl", q[:, 0, :, :nope], w_uk)
            q_full = torch.cat([q_latent, q[:, 0, :, nope:]], dim=-1).unsqueeze(1)  # [B, 1, H, L + rope]
            keys = torch.cat([latent[:, :, : tile.kv_len], rope[:, :, : tile.kv_len]], dim=-1)
            o = F.scaled_dot_product_attention(q_full, keys, latent[:, :, : tile.kv_len], attn_mask=tile.mask, scale=scale)
            o = torch.einsum("bhl,hvl->bhv", o[:, 0], w_uv)
        else:  # naive: the gathered latents up-projected to per-head keys and values
            k_nope = torch.einsum("bsl,hnl->bhsn", latent[:, 0], w_uk)
            keys = torch.cat([k_nope, rope.expand(-1, num_heads, -1, -1)], dim=-1)
            values = torch.einsum("bsl,hvl->bhsv", latent[:, 0], w_uv)
            o = _attend_tiles(q.transpose(1, 2), keys, values, batch.tiles, 1, scale).transpose(1, 2)
        o = o.reshape(nseq * batch.max_q, num_heads, v_dim)
        out.index_copy_(0, batch.out_rows, o if batch.real is None else o.index_select(0, batch.real))
    return out


def _attend_tiles(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[QueryTile], group: int, scale: float
) -> torch.Tensor:
    """SDPA of folded queries [B, Hkv, max_q * group, D], tile by tile, over the context each tile can see."""

    def attend(t: QueryTile) -> torch.Tensor:
        rows = slice(t.start * group, t.end * group)
        return F.scaled_dot_product_attention(
            q[:, :, rows], k[:, :, : t.kv_len], v[:, :, : t.kv_len], attn_mask=t.mask, scale=scale
        )

    return attend(tiles[0]) if len(tiles) == 1 else torch.cat([attend(t) for t in tiles], dim=2)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """Scatter [T, Hkv, D] tokens into the caches at flat slot indices (quantised for an int8 cache)."""
    quant = require_scales(key_cache, kv_scales)
    if quant is not None:
        key, value = quantize(key, quant.key), quantize(value, quant.value)
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise TypeError(f"K/V dtype {key.dtype}/{value.dtype} differs from the cache's {key_cache.dtype}")
    slots = slot_mapping.long()
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)


def token_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slot of every token of every sequence, sequences concatenated: long [sum(seq_lens)]."""
    lens = seq_lens.long()
    total = int(lens.sum())
    seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=lens.device) - first[seq]
    return slot(block_tables[seq, pos // block_size].long(), pos % block_size, block_size)


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    slots = token_slots(block_tables, seq_lens, key_cache.shape[1])
    return (
        key_cache.view(-1, *key_cache.shape[2:]).index_select(0, slots),
        value_cache.view(-1, *value_cache.shape[2:]).index_select(0, slots),
    )


class TorchBackend(KernelBackend):
    """The kernels shared by the cpu and cuda backends; subclasses add device timing, memory and pinning."""

    # Where SDPA has no fast kernel for a dtype, attention math runs in this one instead.
    compute_dtypes: dict[torch.dtype, torch.dtype] = {}

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
        value_head_size: int | None = None,
    ) -> KVCaches:
        return allocate_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, self.device,
                               value_head_size=value_head_size)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales | None = None,
    ) -> None:
        write_kv(key, value, key_cache, value_cache, slot_mapping, kv_scales)

    def attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        if meta.captured:  # a graph's static metadata (realexec/graphs.py): device tensors only
            return token_paged_attention(query, key_cache, value_cache, TokenMetadata.of_step(meta), scale, kv_scales)
        compute_dtype = self.compute_dtypes.get(query.dtype)
        return paged_attention(query, key_cache, value_cache, meta, scale, compute_dtype, kv_scales)

    def mla_attention(
        self,
        query: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        if meta.captured:
            raise ValueError("latent attention runs eagerly: the executor captures no graphs for MLA models")
        compute_dtype = self.compute_dtypes.get(query.dtype, query.dtype)
        out = paged_latent_attention(query.to(compute_dtype), latent_cache, rope_cache, meta, scale, w_uk, w_uv)
        return out.to(query.dtype)

    def moe_experts(self, hidden: torch.Tensor, router_logits: torch.Tensor, moe: MoeWeights, top_k: int) -> torch.Tensor:
        return routed_experts(hidden, router_logits, moe, top_k)

    def gather_kv(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_kv(key_cache, value_cache, block_tables, seq_lens)

    def copy_blocks(self, kv_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        copy_blocks(kv_caches, pairs)
