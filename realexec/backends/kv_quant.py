"""int8 KV cache ("C8") with static per-channel scales: quantise on write, dequantise on read.

One fp32 scale per (kv head, channel) and per K/V, fixed for the run, as Ascend's C8 does
(vllm-ascend's C8 method holds ``key_antiquant_scale``/``value_antiquant_scale`` of
``num_kv_heads * head_size`` per layer and passes them to FIA as antiquant scales). Static
scales make a block's bytes self-contained: copy-on-write and swap move int8 blocks as they
are, and the only extra memory is ``2 * num_kv_heads * head_size`` scales per layer, not
a scale per token as vLLM's CUDA int8/fp8 layouts store.

Symmetric: ``q = clamp(round(x / scale), -127, 127)``, ``x ~= q * scale`` (FIA's antiquant
with ``antiquant_offset=None`` computes exactly ``q * scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
MIN_SCALE = 1e-8  # a channel that is always zero still needs a finite, non-zero scale


@dataclass(frozen=True)
class KVScales:
    """Static per-channel scales of one layer's K and V caches: fp32 [num_kv_heads, head_size] each."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def from_absmax(cls, key_absmax: torch.Tensor, value_absmax: torch.Tensor) -> KVScales:
        """Scales that map each channel's largest magnitude seen to 127."""
        return cls(*(m.float().clamp_min(MIN_SCALE * INT8_MAX) / INT8_MAX for m in (key_absmax, value_absmax)))

    def to(self, device: torch.device | str) -> KVScales:
        return KVScales(self.key.to(device), self.value.to(device))

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 of ``x`` [..., num_kv_heads, head_size] with per-channel ``scale`` [num_kv_heads, head_size]."""
    return torch.round(x.float() / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype``; ``scale`` broadcasts over ``q``'s last two axes (kv head, channel)."""
    return (q.float() * scale).to(dtype)


def require_scales(cache: torch.Tensor, kv_scales: KVScales | None) -> KVScales | None:
    """The scales an int8 cache needs (an error without them); None for a float cache."""
    if cache.dtype != torch.int8:
        return None
    if kv_scales is None:
        raise ValueError("an int8 KV cache needs its layer's KVScales (static per-channel scales)")
    return kv_scales
