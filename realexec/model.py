"""A Llama-style decoder built from a ModelSpec, agnostic of how attention reads its KV.

``forward`` computes the residual stream for a packed batch of tokens and hands every layer's
(q, k, v) to an ``attend`` callable: the executor's writes K/V into the paged cache and runs the
backend's paged attention; the dense reference runs plain causal attention on whole sequences.
Everything else (norms, RoPE, projections, MLP) is shared, so comparing the two compares only
the KV paths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvsim.realexec.backends.kv_quant import KVScales
from kvsim.realexec.weights import load_weights, random_weights, torch_dtype
from kvsim.sim.perf.model_spec import ModelSpec

# attend(layer, q [T, heads, head_dim], k [T, kv_heads, head_dim], v [T, kv_heads, head_dim])
#   -> attention output [T, heads, head_dim]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, accumulated in fp32 (as Hugging Face Llama does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv_proj: torch.Tensor  # [q_size + 2 * kv_size, hidden]: one GEMM instead of three
    o_proj: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor


class DecoderModel:
    """Weights plus the forward pass; no KV state (that belongs to whoever implements ``attend``)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self.scale = spec.head_dim**-0.5
        self.embed = weights["model.embed_tokens.weight"]
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = self.embed if spec.tie_word_embeddings else weights["lm_head.weight"]
        self._rope_cos, self._rope_sin = self._rope_tables()

    @classmethod
    def build(
        cls, spec: ModelSpec, device: torch.device | str = "cpu", seed: int = 0, weights_path: str | Path | None = None
    ) -> DecoderModel:
        """Seeded random weights, or a safetensors checkpoint, on ``device`` in ``spec.weight_dtype``."""
        dtype = torch_dtype(spec.weight_dtype)
        if weights_path is None:
            return cls(spec, random_weights(spec, seed, device, dtype))
        return cls(spec, load_weights(weights_path, spec, device, dtype))

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv_proj=torch.cat([w[attn + "q_proj.weight"], w[attn + "k_proj.weight"], w[attn + "v_proj.weight"]]),
            o_proj=w[attn + "o_proj.weight"],
            q_norm=w.get(attn + "q_norm.weight"),
            k_norm=w.get(attn + "k_norm.weight"),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up_proj=torch.cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]),
            down_proj=w[mlp + "down_proj.weight"],
        )

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_position, head_dim / 2] in fp32 (Llama's default RoPE, no scaling)."""
        d = self.spec.head_dim
        inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(self.spec.max_position, dtype=torch.float64), inv_freq)
        return angles.cos().float().to(self.device), angles.sin().float().to(self.device)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate halves (Hugging Face's layout, which its Llama checkpoints are stored for)."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Residual stream after the last layer, [T, hidden] (before the final norm).

        ``input_ids`` and ``positions`` are [T] on the model's device; tokens of different
        sequences may be packed together, since only ``attend`` looks across tokens.
        """
        spec = self.spec
        t = input_ids.shape[0]
        cos, sin = self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1)
        x = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, spec.rms_norm_eps)
            q, k, v = (h @ layer.qkv_proj.T).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
            q = q.view(t, spec.num_heads, spec.head_dim)
            k = k.view(t, spec.num_kv_heads, spec.head_dim)
            v = v.view(t, spec.num_kv_heads, spec.head_dim)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, spec.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, spec.rms_norm_eps)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            out = attend(i, q, k, v.contiguous())
            x = x + out.reshape(t, spec.q_size).to(x.dtype) @ layer.o_proj.T
            h = rms_norm(x, layer.post_norm, spec.rms_norm_eps)
            gate, up = (h @ layer.gate_up_proj.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down_proj.T
        return x

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of the rows that sample; the final norm runs only on those."""
        return (rms_norm(hidden_rows, self.final_norm, self.spec.rms_norm_eps) @ self.lm_head.T).float()


# ---- int8 KV (C8): which dtypes a cache stores and attends in, and its static scales ----------------

CALIBRATION_PROMPTS = 4  # seeded random-token prompts the int8 scales are calibrated on
CALIBRATION_TOKENS = 1024  # ... each this long (capped at max_position): longer contexts widen V's range
_CALIBRATION_STREAM = 2  # an RNG domain of its own (realexec.prompts uses 0 and 1)


def kv_cache_dtypes(
    kv_dtype: str, model_dtype: torch.dtype, attention_dtypes: tuple[torch.dtype, ...] | None = None
) -> tuple[torch.dtype, torch.dtype]:
    """(dtype the cache stores, dtype attention computes in) for a spec dtype name.

    A float cache attends in its own dtype (q is rounded to it, as the kernels take one dtype);
    an int8 cache stores quantised K/V and attends in the model's dtype after dequantising, or
    in the last of the backend's ``attention_dtypes`` where its kernels do not take the model's.
    """
    if kv_dtype == "int8":
        fits = attention_dtypes is None or model_dtype in attention_dtypes
        return torch.int8, model_dtype if fits else attention_dtypes[-1]
    dtype = torch_dtype(kv_dtype)
    return dtype, dtype


def rope_pair_absmax(k: torch.Tensor) -> torch.Tensor:
    """Per-channel bound of RoPE'd keys [T, Hkv, D] at any position: the norm of each rotated channel pair.

    RoPE rotates channel pairs (i, i + D/2) by a position-dependent angle, so a channel's range at
    positions the calibration never reached can exceed what it saw; the pair's norm cannot be exceeded.
    """
    first, second = k.float().chunk(2, dim=-1)
    pair = torch.sqrt(first.square() + second.square()).amax(0)
    return torch.cat([pair, pair], dim=-1)


def calibrate_kv_scales(
    model: DecoderModel, seed: int, prompts: int = CALIBRATION_PROMPTS, tokens: int = CALIBRATION_TOKENS
) -> list[KVScales]:
    """Static per-channel int8 scales of every layer: each channel's absmax over a seeded prompt set.

    Deterministic for a (model, seed): the prompts are random tokens from the run's seed, the
    same kind of tokens ``realexec.prompts`` feeds a trace's requests. Values beyond a channel's
    calibrated range saturate at +-127.
    """
    spec = model.spec
    tokens = min(tokens, spec.max_position)
    absmax = [
        (torch.zeros(spec.num_kv_heads, spec.head_dim, device=model.device),) * 2 for _ in range(spec.num_layers)
    ]

    def record(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key_max, value_max = absmax[layer]
        absmax[layer] = (torch.maximum(key_max, rope_pair_absmax(k)), torch.maximum(value_max, v.float().abs().amax(0)))
        group = spec.num_heads // spec.num_kv_heads
        heads_first = [t.transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))]
        return F.scaled_dot_product_attention(*heads_first, is_causal=True, scale=model.scale).transpose(0, 1)

    rng = np.random.default_rng([seed % 2**64, _CALIBRATION_STREAM])
    positions = torch.arange(tokens, device=model.device)
    with torch.inference_mode():
        for _ in range(prompts):
            ids = torch.from_numpy(rng.integers(0, spec.vocab_size, size=tokens)).to(model.device)
            model.forward(ids, positions, record)
    return [KVScales.from_absmax(key_max, value_max) for key_max, value_max in absmax]
