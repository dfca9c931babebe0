"""The kernel-backend interface every device path implements (npu, cuda, cpu).

Caches follow vllm-ascend's ND layout: per layer one key cache and one value cache, each
``[num_blocks, block_size, num_kv_heads, head_size]``. A token at position ``p`` of a
sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

Attention reads everything from the paged cache: the model writes the step's new K/V first
(``write_kv``), then ``attention`` lets each query token at position ``context_len + i``
attend to cache positions ``[0, context_len + i]`` of its own sequence (causal over the new
tokens, full over the cached prefix). One call covers prefill, chunked prefill (cached
prefix + new chunk), decode and mixed batches; metadata says which it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step metadata shared by all layers (built once by the executor).

    Sequences are in plan order; queries are packed (TND): sequence ``b`` owns query rows
    ``query_start_loc[b]:query_start_loc[b+1]``.
    """

    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative query lengths, on device
    seq_lens: torch.Tensor  # int32 [B], context after this step (cached + new), on device
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0, on device
    slot_mapping: torch.Tensor  # int32 [T] (npu) or int64 [T], on device
    query_lens_list: list[int]  # host copies: kernels take these as Python lists
    seq_lens_list: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)

    @property
    def context_lens_list(self) -> list[int]:
        """Tokens already in the cache before this step's new ones."""
        return [s - q for s, q in zip(self.seq_lens_list, self.query_lens_list)]


class KernelBackend(ABC):
    """Device-specific paged-KV kernels. Stateless apart from the device it targets."""

    name: str
    device: torch.device

    @abstractmethod
    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_size]."""

    @abstractmethod
    def allocate_host_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The swap pool: same layout in (pinned where the device supports it) host memory."""

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Scatter new ``key``/``value`` [T, num_kv_heads, head_size] into the caches at ``slot_mapping`` [T]."""

    @abstractmethod
    def attention(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Paged attention of ``query`` [T, num_heads, head_size] -> [T, num_heads, head_size]."""

    @abstractmethod
    def gather_kv(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K and V [sum(seq_lens), num_kv_heads, head_size] of each sequence, concatenated."""

    @abstractmethod
    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``src`` -> ``dst`` in every layer's key and value cache."""

    @abstractmethod
    def swap(
        self,
        src_caches: list[tuple[torch.Tensor, torch.Tensor]],
        dst_caches: list[tuple[torch.Tensor, torch.Tensor]],
        pairs: list[tuple[int, int]],
    ) -> None:
        """Copy blocks between device and host pools (either direction), block ``src`` -> ``dst``."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued device work."""

    @abstractmethod
    def memory_in_use(self) -> int:
        """Bytes the framework has allocated on the device (0 where it cannot be measured)."""

    @abstractmethod
    def elapsed(self, fn) -> tuple[object, float]:
        """Run ``fn()`` and return (its result, device seconds it took), measured with device events."""
