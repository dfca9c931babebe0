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
from kvsim.realexec.tensor_parallel import TensorParallelGroup, shard_weights
from kvsim.realexec.weights import iter_random_weights, load_weights, random_weights, torch_dtype
from kvsim.sim.perf.model_spec import ModelSpec

# attend(layer, q [T, heads, head_dim], k, v) -> attention output [T, heads, v_head_dim]: k and v are what
# the layer caches for the new tokens, the pair a paged pool's (key_cache, value_cache) holds. Per-head
# attention: K and V [T, kv_heads, head_dim]. Latent attention (MLA): the normalised latent
# [T, 1, kv_lora_rank] and the RoPE'd rope key [T, 1, qk_rope_head_dim]; ``DecoderModel.layers[layer].mla``
# holds the up-projections that turn them into per-head keys and values.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# experts(hidden [T, h], router_logits [T, E], weights, top_k) -> the routed experts' output [T, h]
Experts = Callable[[torch.Tensor, torch.Tensor, "MoeWeights", int], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, accumulated in fp32 (as Hugging Face Llama does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class Mlp:
    """A SwiGLU MLP: the fused gate/up projection, then down."""

    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]: one GEMM instead of two
    down_proj: torch.Tensor

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = (h @ self.gate_up_proj.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down_proj.T


def _mlp(w: dict[str, torch.Tensor], p: str) -> Mlp:
    return Mlp(torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]), w[p + "down_proj.weight"])


@dataclass
class MoeWeights:
    """One MoE layer: the router, every routed expert's weights stacked, and the shared experts (if any)."""

    router: torch.Tensor  # [E, hidden]: mlp.gate, over every expert of the model
    w13: torch.Tensor  # [E_here, 2 * moe_intermediate, hidden]: each expert's gate rows, then its up rows
    w2: torch.Tensor  # [E_here, hidden, moe_intermediate]: each expert's down projection
    shared: Mlp | None
    first_expert: int = 0  # the global id of w13[0]: an expert-parallel rank holds E_here = E / ep of them


@dataclass
class MlaWeights:
    """One latent-attention layer (DeepSeek-V2/V3 names in the comments)."""

    q_proj: torch.Tensor | None  # [heads * (nope + rope), hidden]; None when queries go through q_lora_rank
    q_a_proj: torch.Tensor | None  # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor | None
    q_b_proj: torch.Tensor | None  # [heads * (nope + rope), q_lora_rank]
    kv_a_proj: torch.Tensor  # [kv_lora_rank + rope, hidden]: kv_a_proj_with_mqa, the latent and the rope key
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor  # [heads, nope, kv_lora_rank]: kv_b_proj's key rows, latent -> no-rope keys
    w_uv: torch.Tensor  # [heads, v_head_dim, kv_lora_rank]: kv_b_proj's value rows, latent -> values


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv_proj: torch.Tensor | None  # [q_size + 2 * kv_size, hidden]: one GEMM instead of three (None under MLA)
    o_proj: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    mlp: Mlp | None  # a dense layer's MLP (None in an MoE layer)
    moe: MoeWeights | None = None
    mla: MlaWeights | None = None


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]): softmax over the experts, the top-k, renormalised to sum to 1.

    One routing rule for every MoE model here: Mixtral's and Qwen3-MoE's (``norm_topk_prob``), and
    what vllm-ascend's softmax router does with ``renormalize`` (npu_moe_gating_top_k_softmax, then
    the weights divided by their sum). DeepSeek-V2's unnormalised weights and V3's sigmoid scores
    with grouped top-k are not modelled: step time does not depend on the weights' values.
    """
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def routed_experts(hidden: torch.Tensor, router_logits: torch.Tensor, moe: MoeWeights, top_k: int) -> torch.Tensor:
    """The routed experts as vLLM's MoE kernels run them, in portable torch: the step's (token, expert)
    pairs sorted by expert (a permutation, as npu_moe_init_routing's), each touched expert's rows through
    its gate/up GEMM, SiLU-and-mul and down GEMM, then each row scaled by its routing weight and added
    back to its token (the unpermute). Experts no token picked cost nothing; an expert-parallel rank
    runs the pairs of the experts it holds (``moe.first_expert`` on), the rest is other ranks' part."""
    weights, ids = route(router_logits, top_k)
    flat = ids.reshape(-1) - moe.first_expert
    here = moe.w13.shape[0]
    order = torch.argsort(flat, stable=True)
    if here < router_logits.shape[1]:  # an expert-parallel rank: the pairs of its experts alone
        order = order[(flat[order] >= 0) & (flat[order] < here)]
    if not order.numel():
        return torch.zeros_like(hidden)
    counts = torch.bincount(flat[order], minlength=here).tolist()
    tokens = order // top_k
    rows = hidden.index_select(0, tokens)
    outputs, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            gate, up = (rows[start : start + n] @ moe.w13[expert].T).chunk(2, dim=-1)
            outputs.append((F.silu(gate) * up) @ moe.w2[expert].T)
            start += n
    scaled = torch.cat(outputs) * weights.reshape(-1).index_select(0, order).to(hidden.dtype)[:, None]
    return torch.zeros_like(hidden).index_add_(0, tokens, scaled)


class DecoderModel:
    """Weights plus the forward pass; no KV state (that belongs to whoever implements ``attend``).

    Under tensor parallelism (``tp``) it is one rank's shard: ``spec`` is the rank's model
    (``sim.parallel.layout.rank_model``), and the forward pass runs vLLM's collectives
    (realexec/tensor_parallel.py): an all-reduce after the embedding, after every attention's
    output projection and every MLP or MoE layer, and an all-gather of the logits.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], tp: TensorParallelGroup | None = None,
                 top_k: int | None = None) -> None:
        self.spec = spec
        self.tp = tp
        self.top_k = top_k or spec.num_experts_per_tok  # the model's: an expert-parallel rank's spec caps it at its experts
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
        cls, spec: ModelSpec, device: torch.device | str = "cpu", seed: int = 0, weights_path: str | Path | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> DecoderModel:
        """Seeded random weights, or a safetensors checkpoint, on ``device`` in ``spec.weight_dtype``;
        with ``tp``, this rank's shard of them (the same seed gives every layout the same model)."""
        dtype = torch_dtype(spec.weight_dtype)
        if tp is None or tp.size == 1:
            if weights_path is None:
                return cls(spec, random_weights(spec, seed, device, dtype))
            return cls(spec, load_weights(weights_path, spec, device, dtype))
        full = (iter_random_weights(spec, seed, device, dtype) if weights_path is None
                else iter(load_weights(weights_path, spec, device, dtype).items()))
        return cls(tp.rank_spec(spec), shard_weights(spec, full, tp), tp, spec.num_experts_per_tok)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        spec, p = self.spec, f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        moe = spec.is_moe and i >= spec.dense_layers
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv_proj=None if spec.is_mla else torch.cat(
                [w[attn + "q_proj.weight"], w[attn + "k_proj.weight"], w[attn + "v_proj.weight"]]),
            o_proj=w[attn + "o_proj.weight"],
            q_norm=w.get(attn + "q_norm.weight"),
            k_norm=w.get(attn + "k_norm.weight"),
            post_norm=w[p + "post_attention_layernorm.weight"],
            mlp=None if moe else _mlp(w, mlp),
            moe=self._moe(w, mlp) if moe else None,
            mla=self._mla(w, attn) if spec.is_mla else None,
        )

    def _moe(self, w: dict[str, torch.Tensor], p: str) -> MoeWeights:
        experts = range(self.spec.num_experts)
        return MoeWeights(
            router=w[p + "gate.weight"],
            w13=torch.stack([torch.cat([w[f"{p}experts.{e}.gate_proj.weight"], w[f"{p}experts.{e}.up_proj.weight"]])
                             for e in experts]),
            w2=torch.stack([w[f"{p}experts.{e}.down_proj.weight"] for e in experts]),
            shared=_mlp(w, p + "shared_experts.") if self.spec.shared_expert_intermediate_size else None,
            first_expert=0 if self.tp is None else self.tp.first_expert(self.spec.num_experts),
        )

    def _mla(self, w: dict[str, torch.Tensor], p: str) -> MlaWeights:
        s = self.spec
        up = w[p + "kv_b_proj.weight"].view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = up.split([s.qk_nope_head_dim, s.v_head_dim], dim=1)
        return MlaWeights(
            q_proj=w.get(p + "q_proj.weight"),
            q_a_proj=w.get(p + "q_a_proj.weight"),
            q_a_norm=w.get(p + "q_a_layernorm.weight"),
            q_b_proj=w.get(p + "q_b_proj.weight"),
            kv_a_proj=w[p + "kv_a_proj_with_mqa.weight"],
            kv_a_norm=w[p + "kv_a_layernorm.weight"],
            w_uk=w_uk.contiguous(),
            w_uv=w_uv.contiguous(),
        )

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_position, rotated dims / 2] in fp32 (Llama's default RoPE, no scaling).

        Under MLA only the rope part of each query and key rotates (qk_rope_head_dim dims).
        """
        d = self.spec.qk_rope_head_dim if self.spec.is_mla else self.spec.head_dim
        inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(self.spec.max_position, dtype=torch.float64), inv_freq)
        return angles.cos().float().to(self.device), angles.sin().float().to(self.device)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate halves (Hugging Face's layout, which its Llama checkpoints are stored for; DeepSeek's
        checkpoints store the rope dims interleaved, which a loader would permute once)."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend, experts: Experts = routed_experts
    ) -> torch.Tensor:
        """Residual stream after the last layer, [T, hidden] (before the final norm).

        ``input_ids`` and ``positions`` are [T] on the model's device; tokens of different
        sequences may be packed together, since only ``attend`` looks across tokens.
        ``experts`` runs an MoE layer's routed experts (a backend's kernels; default the portable ones).
        """
        spec = self.spec
        t = input_ids.shape[0]
        cos, sin = self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1)
        x = self._embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, spec.rms_norm_eps)
            if layer.mla is not None:
                out = self._latent_attention(i, layer.mla, h, cos, sin, attend)
            else:
                q, k, v = (h @ layer.qkv_proj.T).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
                q = q.view(t, spec.num_heads, spec.head_dim)
                k = k.view(t, spec.num_kv_heads, spec.head_dim)
                v = v.view(t, spec.num_kv_heads, spec.head_dim)
                if layer.q_norm is not None:
                    q = rms_norm(q, layer.q_norm, spec.rms_norm_eps)
                    k = rms_norm(k, layer.k_norm, spec.rms_norm_eps)
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
                out = attend(i, q, k, v.contiguous())
            x = x + self._reduce(out.reshape(t, -1).to(x.dtype) @ layer.o_proj.T)
            h = rms_norm(x, layer.post_norm, spec.rms_norm_eps)
            x = x + self._reduce(layer.mlp(h) if layer.moe is None else self._mixture(layer.moe, h, experts))
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; a TP rank looks up the ids its vocabulary rows hold, zero elsewhere, and the ranks' rows are summed."""
        if self.tp is None:
            return self.embed[input_ids]
        rows = self.embed.shape[0]
        local = input_ids - self.tp.rank * rows
        held = (local >= 0) & (local < rows)
        return self.tp.all_reduce(self.embed[local.clamp(0, rows - 1)] * held.unsqueeze(1).to(self.dtype))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: the sum of the ranks' partial outputs (itself on one device)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _latent_attention(
        self, i: int, mla: MlaWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """DeepSeek's MLA up to the cache: queries (through the query latent when q_lora_rank is set),
        the joint latent + rope-key projection, the latent's norm and RoPE on the rope parts."""
        s, t = self.spec, h.shape[0]
        if mla.q_proj is not None:
            q = h @ mla.q_proj.T
        else:
            q = rms_norm(h @ mla.q_a_proj.T, mla.q_a_norm, s.rms_norm_eps) @ mla.q_b_proj.T
        q_nope, q_pe = q.view(t, s.num_heads, s.head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        latent, k_pe = (h @ mla.kv_a_proj.T).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, mla.kv_a_norm, s.rms_norm_eps)
        q = torch.cat([q_nope, self._rope(q_pe, cos, sin)], dim=-1)
        return attend(i, q, latent.unsqueeze(1).contiguous(), self._rope(k_pe.unsqueeze(1), cos, sin).contiguous())

    def _mixture(self, moe: MoeWeights, h: torch.Tensor, experts: Experts) -> torch.Tensor:
        """The router GEMM, the routed experts (``experts``) and the shared experts, added."""
        out = experts(h, h @ moe.router.T, moe, self.top_k)
        return out if moe.shared is None else out + moe.shared(h)

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of the rows that sample; the final norm runs only on those.
        A TP rank's vocabulary slices are gathered from every rank (the padding rows dropped)."""
        local = (rms_norm(hidden_rows, self.final_norm, self.spec.rms_norm_eps) @ self.lm_head.T).float()
        if self.tp is None:
            return local
        return self.tp.all_gather_last(local)[:, : self.spec.sampled_vocab_size]


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
