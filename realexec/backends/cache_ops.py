"""Block-level cache management shared by every backend: allocation, copy-on-write and swap.

These move whole blocks and involve no attention math, so plain tensor copies are what every
engine does here too (vLLM's ``swap_blocks`` is one async memcpy per block, vllm-ascend copies
blocks with torch indexing); only the kernels that read and write tokens differ by device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
    value_head_size: int | None = None,
) -> KVCaches:
    """Per layer (key_cache, value_cache) of zeros, ND ``[num_blocks, block_size, num_kv_heads, head_size]``.

    ``value_head_size`` (default ``head_size``) sizes the value cache apart: latent attention (MLA)
    keeps the latent in the "key" cache and the rope key in the "value" cache, one head each, as
    vllm-ascend splits its MLA cache into a no-rope and a rope part.

    Zeros rather than ``empty``: padded slots are masked, but a NaN bit pattern left in an
    unused slot would still turn ``0 * NaN`` into NaN inside a masked matmul.
    """
    for name, n in (
        ("num_layers", num_layers),
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
        ("value_head_size", head_size if value_head_size is None else value_head_size),
    ):
        if n <= 0:
            raise ValueError(f"{name} must be positive, got {n}")
    shape = (num_blocks, block_size, num_kv_heads)

    def zeros(size: int) -> torch.Tensor:
        return torch.zeros((*shape, size), dtype=dtype, device=device, pin_memory=pin_memory)

    value_size = head_size if value_head_size is None else value_head_size
    return [(zeros(head_size), zeros(value_size)) for _ in range(num_layers)]


def copy_blocks(kv_caches: KVCaches, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy block ``src`` to block ``dst`` in every layer; all sources are read before any write."""
    if not pairs:
        return
    _check_unique_destinations(pairs)
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
    for key_cache, value_cache in kv_caches:
        key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
        value_cache.index_copy_(0, dst, value_cache.index_select(0, src))


def swap_blocks(
    src_caches: KVCaches, dst_caches: KVCaches, pairs: Sequence[tuple[int, int]], non_blocking: bool
) -> None:
    """Copy blocks between pools on different devices, one copy per run of consecutive blocks.

    Direct slice-to-slice copies (no index_select staging on the host) keep every transfer on
    the device stream: a host gather would read a pinned block before an earlier asynchronous
    swap-out had landed in it.
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"swap between {len(src_caches)} and {len(dst_caches)} layers")
    if not pairs:
        return
    if src_caches[0][0].shape[1:] != dst_caches[0][0].shape[1:]:
        raise ValueError(
            f"block shapes differ: {tuple(src_caches[0][0].shape[1:])} vs {tuple(dst_caches[0][0].shape[1:])}"
        )
    _check_unique_destinations(pairs)
    for src, dst, n in block_runs(pairs):
        for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches):
            dst_k[dst : dst + n].copy_(src_k[src : src + n], non_blocking=non_blocking)
            dst_v[dst : dst + n].copy_(src_v[src : src + n], non_blocking=non_blocking)


def block_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both source and destination blocks are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _check_unique_destinations(pairs: Sequence[tuple[int, int]]) -> None:
    dsts = [d for _, d in pairs]
    if len(set(dsts)) != len(dsts):
        raise ValueError(f"a destination block appears twice in {list(pairs)}: the result would depend on copy order")
