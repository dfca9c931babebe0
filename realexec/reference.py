"""Dense greedy generation: the obviously-correct baseline that paged runs must reproduce.

No cache, no paging, no batching: every new token recomputes causal attention (the backends'
float64 ``dense_attention``) over the whole contiguous sequence. Quadratic and slow, which is
fine for the short sequences tests use.
"""

from __future__ import annotations

import torch

from kvsim.realexec.backends.reference import dense_attention
from kvsim.realexec.model import Attend, DecoderModel


def causal_attend(model: DecoderModel, seq_len: int, kv_dtype: torch.dtype | None = None) -> Attend:
    """``attend`` for one whole sequence of ``seq_len`` tokens: each attends to itself and its past.

    With ``kv_dtype``, q, k and v are first rounded to it, as a paged run stores its cache.
    """
    def attend(_layer, q, k, v):
        if kv_dtype is not None:
            q, k, v = q.to(kv_dtype), k.to(kv_dtype), v.to(kv_dtype)
        return dense_attention(q, k, v, [seq_len], [seq_len], model.scale)

    return attend


def dense_generate(model: DecoderModel, prompt_ids: list[int], num_tokens: int, kv_dtype: torch.dtype | None = None) -> list[int]:
    """The ``num_tokens`` tokens greedy decoding appends to ``prompt_ids`` (attention inputs in ``kv_dtype``)."""
    tokens = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
            positions = torch.arange(len(tokens), device=model.device)
            hidden = model.forward(ids, positions, causal_attend(model, len(tokens), kv_dtype))
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
        hidden = model.forward(ids, positions, causal_attend(model, len(tokens), kv_dtype))
        logits = model.logits(hidden[len(prompt_ids) - 1 : -1])
        chosen = logits.gather(-1, torch.tensor(generated, device=model.device).unsqueeze(-1)).squeeze(-1)
        return (logits.max(dim=-1).values - chosen).tolist()
