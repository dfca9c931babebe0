"""Chained block hashes for automatic prefix caching.

Engine block ``j`` of a request is identified by ``hash((hash of block j-1, content key))``,
so equal hashes mean equal whole prefixes, as in vLLM. The content key comes from, in order:
the prompt's token ids when the trace has them; else the trace's prefix-block hashes (a
trace block of H tokens maps onto engine blocks of any size B dividing H, keyed by
(trace hash, sub-block index), or any multiple of H, keyed by the covered trace hashes);
else the request's own identity, so only the request itself (after a preemption) can hit.
Generated tokens are unknown to the simulator and keyed by the sequence that produced them.

Python's ``hash`` of a tuple of ints is deterministic across runs (no PYTHONHASHSEED), so
the decision log does not depend on the interpreter's hash randomisation.
"""

from __future__ import annotations

from kvsim.policies.request import Request

ROOT_HASH = 0x6B7673696D  # arbitrary fixed parent of every first block
_TOKENS, _TRACE, _PROMPT, _GENERATED = 1, 2, 3, 4


def check_block_size_compatible(block_size: int, hash_block_size: int) -> None:
    if hash_block_size % block_size and block_size % hash_block_size:
        raise ValueError(
            f"engine block size {block_size} and trace hash block size {hash_block_size} are incompatible: "
            "one must divide the other for trace prefix hashes to map onto engine blocks"
        )


def content_key(request: Request, j: int, block_size: int) -> tuple:
    """What block ``j`` (tokens ``[j*B, (j+1)*B)``) holds, as a hashable key of ints."""
    start, end = j * block_size, (j + 1) * block_size
    if end <= request.prompt_tokens:
        if request.token_ids is not None:
            return (_TOKENS, *request.token_ids[start:end])
        hashes, H = request.trace_hashes, request.hash_block_size
        if hashes is not None and H:
            if H >= block_size:
                b = start // H
                if b < len(hashes):
                    return (_TRACE, hashes[b], (start % H) // block_size)
            else:
                first, last = start // H, end // H
                if last <= len(hashes):
                    return (_TRACE, *hashes[first:last])
        return (_PROMPT, request.content_id, j)
    return (_GENERATED, request.order, j)


def extend_block_hashes(hashes: list[int], request: Request, num_full_blocks: int, block_size: int) -> list[int]:
    """Grow ``hashes`` (the request's chain so far) to cover ``num_full_blocks`` blocks."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for j in range(len(hashes), num_full_blocks):
        parent = hash((parent, content_key(request, j, block_size)))
        hashes.append(parent)
    return hashes
