"""Dense greedy generation: the obviously-correct baseline that paged runs must reproduce.

No cache, no paging, no batching: every new token recomputes causal attention (the backends'
float64 ``dense_attention``) over the whole contiguous sequence; latent attention up-projects every
latent to per-head K and V, and an MoE layer runs every expert on every token (``dense_experts``).
Quadratic and slow, which is fine for the short sequences tests use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvsim.realexec.backends.reference import dense_attention
from kvsim.realexec.model import Attend, DecoderModel, MoeWeights, route


def causal_attend(model: DecoderModel, seq_len: int, kv_dtype: torch.dtype | None = None) -> Attend:
    """``attend`` for one whole sequence of ``seq_len`` tokens: each attends to itself and its past.

    With ``kv_dtype``, q, k and v are first rounded to it, as a paged run stores its cache.
    Under latent attention (MLA) k and v are the latent and the rope key (``model.Attend``): every
    position's latent is up-projected to per-head keys and values, the textbook form of the layer
    with nothing absorbed, whatever the paged backends do.
    """
    def attend(layer, q, k, v):
        if kv_dtype is not None:
            q, k, v = q.to(kv_dtype), k.to(kv_dtype), v.to(kv_dtype)
        mla = model.layers[layer].mla
        if mla is not None:
            k, v = up_project(k[:, 0], v, mla.w_uk.to(k.dtype), mla.w_uv.to(k.dtype))
        return dense_attention(q, k, v, [seq_len], [seq_len], model.scale)

    return attend


def up_project(
    latent: torch.Tensor, rope_key: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's per-head keys [T, H, nope + rope] and values [T, H, v] from latents [T, L] and rope keys [T, 1, rope]."""
    heads = w_uk.shape[0]
    k_nope = torch.einsum("tl,hnl->thn", latent, w_uk)
    return torch.cat([k_nope, rope_key.expand(-1, heads, -1)], dim=-1), torch.einsum("tl,hvl->thv", latent, w_uv)


def dense_experts(hidden: torch.Tensor, router_logits: torch.Tensor, moe: MoeWeights, top_k: int) -> torch.Tensor:
    """The routed experts the obvious way: every expert on every token, weighted by a dense [T, E] routing
    matrix (zero where a token did not pick the expert). No sorting, gathering or scattering: the yardstick
    for the backends' grouped paths."""
    weights, ids = route(router_logits, top_k)
    dense = torch.zeros_like(router_logits, dtype=torch.float32).scatter_(1, ids, weights)
    out = torch.zeros_like(hidden)
    for expert in range(moe.w13.shape[0]):  # the experts held here: all, or an expert-parallel rank's
        gate, up = (hidden @ moe.w13[expert].T).chunk(2, dim=-1)
        chosen = dense[:, moe.first_expert + expert, None]
        out += chosen.to(hidden.dtype) * ((F.silu(gate) * up) @ moe.w2[expert].T)
    return out


def dense_generate(model: DecoderModel, prompt_ids: list[int], num_tokens: int, kv_dtype: torch.dtype | None = None) -> list[int]:
    """The ``num_tokens`` tokens greedy decoding appends to ``prompt_ids`` (attention inputs in ``kv_dtype``)."""
    tokens = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
            positions = torch.arange(len(tokens), device=model.device)
            hidden = model.forward(ids, positions, causal_attend(model, len(tokens), kv_dtype), dense_experts)
            tokens.append(int(model.logits(hidden[-1:]).argmax(dim=-1)))
    return tokens[len(prompt_ids) :]


def greedy_gaps(model: DecoderModel, prompt_ids: list[int], generated: list[int], kv_dtype: torch.dtype | None = None) -> list[float]:
    """For each generated token, how far its logit lies below the best one, the text before it given.

    Teacher-forced: one causal pass over prompt and generated tokens. All zeros means ``generated``
    is what greedy decoding would produce; a small positive gap is a near-tie decided the other way
    by rounding (a reduced-precision cache), a large one is a wrong context.
    """
    tokens = list(prompt_ids) + list(generated)
    with torch.inference_mode():
        ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
        positions = torch.arange(len(tokens), device=model.device)
        hidden = model.forward(ids, positions, causal_attend(model, len(tokens), kv_dtype), dense_experts)
        logits = model.logits(hidden[len(prompt_ids) - 1 : -1])
        chosen = logits.gather(-1, torch.tensor(generated, device=model.device).unsqueeze(-1)).squeeze(-1)
        return (logits.max(dim=-1).values - chosen).tolist()
