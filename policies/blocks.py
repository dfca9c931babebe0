"""Block arithmetic every layer shares: blocks for a token count, and a token's KV slot.

A paged KV cache is ``[num_blocks, block_size, ...]`` viewed flat: position ``p`` of a
sequence whose block table is ``table`` lives at slot ``table[p // B] * B + p % B``. The
engine, the plan checker, the cost model, the profiler and the kernel backends all use
these two formulas; they work on ints and elementwise on NumPy arrays and torch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

N = TypeVar("N")  # int, numpy array or torch tensor


def cdiv(a: N, b: int) -> N:
    """``ceil(a / b)`` in integers: the blocks that ``a`` tokens occupy."""
    return -(-a // b)


def slot(block_id: N, offset: N, block_size: int) -> N:
    """The flat KV slot of token ``offset`` inside block ``block_id``."""
    return block_id * block_size + offset


def decode_slots(positions: Sequence[int], tables: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """Slots of one token per sequence (a decode step): ``slot`` inlined, for the hot path."""
    bs = block_size
    return [table[p // bs] * bs + p % bs for p, table in zip(positions, tables)]


def batch_slots(positions: Sequence[int], counts: Sequence[int], tables: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """The flat slot mapping of a step's entries (first positions, token counts, block tables), in entry order."""
    if counts.count(1) == len(counts):  # one token each (decodes): the common step
        return decode_slots(positions, tables, block_size)
    out: list[int] = []
    for first, n, table in zip(positions, counts, tables):
        out += slots_for(table, first, first + n, block_size)
    return out


def slots_for(table: Sequence[int], first: int, end: int, block_size: int) -> list[int]:
    """Slots of positions ``[first, end)`` of a sequence with block table ``table``."""
    if end - first == 1:
        return [slot(table[first // block_size], first % block_size, block_size)]
    slots: list[int] = []
    pos = first
    while pos < end:  # one contiguous run per block
        index = pos // block_size
        block_end = min(end, (index + 1) * block_size)
        base = slot(table[index], -index * block_size, block_size)
        slots.extend(range(base + pos, base + block_end))
        pos = block_end
    return slots
