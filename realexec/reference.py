"""Dense greedy generation: the obviously-correct baseline that paged runs must reproduce.

No cache, no paging, no batching: every new token recomputes causal attention over the whole
contiguous sequence. Quadratic and slow, which is fine for the short sequences tests use.
"""

from __future__ import annotations

import torch

from realexec.model import DecoderModel


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of one whole sequence: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] (fp32 math)."""
    t, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def dense_generate(model: DecoderModel, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """The ``num_tokens`` tokens greedy decoding appends to ``prompt_ids``."""
    tokens = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
            positions = torch.arange(len(tokens), device=model.device)
            hidden = model.forward(ids, positions, lambda _layer, q, k, v: causal_attention(q, k, v, model.scale))
            tokens.append(int(model.logits(hidden[-1:]).argmax(dim=-1)))
    return tokens[len(prompt_ids) :]
