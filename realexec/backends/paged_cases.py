"""Random paged batches with known contents, for checking a backend against the dense reference.

A case holds every sequence's whole context as packed K/V (what ``dense_attention`` reads) and the
same tokens laid out in a paged cache through a shuffled, non-contiguous block table (what a
backend reads). ``load_case`` writes the cached prefix and then the step's new tokens through the
backend's own ``write_kv``, so a case checks writing and attending together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvsim.policies.blocks import cdiv, slot
from kvsim.realexec.backends.base import AttentionMetadata, KernelBackend
from kvsim.realexec.backends.kv_quant import KVScales
from kvsim.realexec.backends.reference import dense_attention


@dataclass
class PagedCase:
    query: torch.Tensor  # [sum(query_lens), H, D]
    key: torch.Tensor  # [sum(seq_lens), Hkv, D]: whole contexts, sequences concatenated
    value: torch.Tensor
    meta: AttentionMetadata
    num_blocks: int
    scale: float

    @property
    def context_rows(self) -> torch.Tensor:
        """Rows of ``key``/``value`` already cached before the step (each sequence's prefix)."""
        return self._rows(new=False)

    @property
    def new_rows(self) -> torch.Tensor:
        """Rows of ``key``/``value`` the step adds (each sequence's last ``query_len`` tokens)."""
        return self._rows(new=True)

    def _rows(self, new: bool) -> torch.Tensor:
        rows, start = [], 0
        for q, s in zip(self.meta.query_lens_list, self.meta.seq_lens_list):
            rows.append(torch.arange(start + s - q, start + s) if new else torch.arange(start, start + s - q))
            start += s
        return torch.cat(rows).to(self.key.device)

    def absmax_scales(self) -> KVScales:
        """C8 scales calibrated on the case's own K/V (each channel's largest magnitude maps to 127)."""
        return KVScales.from_absmax(self.key.abs().amax(0), self.value.abs().amax(0))

    def expected(self) -> torch.Tensor:
        return dense_attention(
            self.query, self.key, self.value, self.meta.query_lens_list, self.meta.seq_lens_list, self.scale
        )


def random_case(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    slot_dtype: torch.dtype = torch.int64,
) -> PagedCase:
    """Random Q/K/V; each sequence gets randomly chosen blocks, and the table one unused column."""
    gen = torch.Generator().manual_seed(seed)
    needed = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start : start + n] + [0])  # a padding column beyond the last needed block
        start += n

    def randn(rows: int, heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, head_size, generator=gen).to(device=device, dtype=dtype)

    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device, slot_dtype)
    return PagedCase(
        query=randn(sum(query_lens), num_heads),
        key=randn(sum(seq_lens), num_kv_heads),
        value=randn(sum(seq_lens), num_kv_heads),
        meta=meta,
        num_blocks=num_blocks,
        scale=head_size**-0.5,
    )


def load_case(
    backend: KernelBackend, case: PagedCase, kv_scales: KVScales | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh single-layer caches holding the case's contexts, written through ``backend.write_kv``.

    With ``kv_scales`` the caches are int8 (C8) and the writes quantise.
    """
    dtype = case.key.dtype if kv_scales is None else torch.int8
    key_cache, value_cache = backend.allocate_kv_cache(
        1, case.num_blocks, case.meta.block_size, case.key.shape[1], case.key.shape[2], dtype
    )[0]
    all_slots = _all_slots(case.meta)
    prefix = case.context_rows
    if len(prefix):
        backend.write_kv(
            case.key[prefix],
            case.value[prefix],
            key_cache,
            value_cache,
            all_slots[prefix.cpu()].to(case.meta.slot_mapping),
            kv_scales,
        )
    new = case.new_rows
    backend.write_kv(
        case.key[new].contiguous(), case.value[new].contiguous(), key_cache, value_cache, case.meta.slot_mapping, kv_scales
    )
    return key_cache, value_cache


def _all_slots(meta: AttentionMetadata) -> torch.Tensor:
    """Host slot of every context token, sequences concatenated (independent of any backend)."""
    tables = meta.block_tables.cpu().long()
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs), torch.tensor(meta.seq_lens_list))
    pos = torch.cat([torch.arange(s) for s in meta.seq_lens_list])
    return slot(tables[seq, pos // meta.block_size], pos % meta.block_size, meta.block_size)
