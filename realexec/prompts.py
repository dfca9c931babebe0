"""Prompt token ids for a request, synthesised reproducibly so shared prefixes really are shared.

Traces give lengths and, at most, prefix-block hashes; the real executor needs tokens. The
tokens of a hashed block come from an RNG keyed on (seed, that block's hash), so the same hash
always means the same tokens, and two prompts whose hash sequences agree up to block ``i`` agree
token for token up to there: the prefix cache the engine builds from those hashes then holds KV
that really is reusable. Trace hashes are prefix-chained (a block's hash names its whole
prefix), so keying on the hash alone keeps the chain. Tokens with no hash are keyed on the
request's ``content_id``, which parallel samples share with their root.
"""

from __future__ import annotations

import numpy as np

from kvsim.policies.request import Request

_BLOCK_STREAM = 0  # domain tags keep a hash value and a content id from ever sharing a stream
_CONTENT_STREAM = 1


def _random_tokens(seed: int, stream: int, key: int, count: int, vocab_size: int) -> list[int]:
    rng = np.random.default_rng([seed % 2**64, stream, key % 2**64])
    return rng.integers(0, vocab_size, size=count).tolist()


def prompt_tokens(request: Request, vocab_size: int, seed: int) -> list[int]:
    """The request's ``prompt_tokens`` token ids, all in ``[0, vocab_size)``."""
    n = request.prompt_tokens
    if request.token_ids is not None:
        return _given_tokens(request, vocab_size)
    tokens: list[int] = []
    if request.trace_hashes:
        if not request.hash_block_size or request.hash_block_size <= 0:
            raise ValueError(f"request {request.request_id}: trace_hashes given without a positive hash_block_size")
        for block_hash in request.trace_hashes:
            if len(tokens) >= n:
                break
            count = min(request.hash_block_size, n - len(tokens))
            tokens += _random_tokens(seed, _BLOCK_STREAM, block_hash, count, vocab_size)
    if len(tokens) < n:
        # Unique suffix after the hashed prefix: positions continue, so it never repeats a prefix.
        tail = _random_tokens(seed, _CONTENT_STREAM, request.content_id, n, vocab_size)
        tokens += tail[len(tokens) :]
    return tokens


def _given_tokens(request: Request, vocab_size: int) -> list[int]:
    tokens = list(request.token_ids or ())
    if len(tokens) != request.prompt_tokens:
        raise ValueError(f"request {request.request_id}: {len(tokens)} token_ids but prompt_tokens = {request.prompt_tokens}")
    for i, tok in enumerate(tokens):
        if not 0 <= tok < vocab_size:
            raise ValueError(f"request {request.request_id}: token_ids[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")
    return tokens
