"""Token-addressed paged attention as a Triton kernel (the cuda backend's paged attention without FlashInfer).

One program per (query token, KV head) runs the online softmax over the blocks its token can see,
reading them through the block table: its cost follows the context, and every per-step value it
reads (block table, token rows, positions) lives in device tensors, so a CUDA graph can capture
it (``realexec/graphs.py``). The query heads sharing a KV head are handled together, padded to
16 rows for ``tl.dot``. vLLM's Triton attention backend (``vllm/attention/ops/``) takes the same
approach of one kernel for prefill, decode and mixed batches; this one is written for kvsim's
``[num_blocks, block_size, num_kv_heads, head_size]`` caches. Float caches only: an int8 (C8)
cache takes the portable path. Checked against :func:`token_attention.token_paged_attention`.
"""

from __future__ import annotations

import torch

from kvsim.realexec.backends.token_attention import TokenMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CPU installs)
    triton = None

MIN_DOT = 16  # tl.dot's smallest dimension


def available() -> bool:
    """Whether Triton imports here."""
    return triton is not None


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: float caches of the query's dtype, power-of-two head size and block size >= 16."""
    head_size, block_size = query.shape[-1], key_cache.shape[1]

    def power_of_two(n: int) -> bool:
        return n >= MIN_DOT and n & (n - 1) == 0

    return (
        triton is not None
        and query.is_cuda
        and key_cache.dtype == query.dtype
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and power_of_two(head_size)
        and power_of_two(block_size)
    )


if triton is not None:

    @triton.jit
    def _token_attention_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, token_seq_ptr, positions_ptr, num_real_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
        GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
        PADDED: tl.constexpr,
    ):
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        row = tl.load(token_seq_ptr + token).to(tl.int64)
        position = tl.load(positions_ptr + token)
        g = tl.arange(0, GROUP_ROWS)
        d = tl.arange(0, HEAD)
        s = tl.arange(0, BLOCK)
        heads = kv_head * GROUP + g
        real = g < GROUP
        q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=real[:, None], other=0.0)
        m = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_ROWS], tl.float32)
        acc = tl.zeros([GROUP_ROWS, HEAD], tl.float32)
        num_blocks = position // BLOCK + 1
        if PADDED:  # a padding row of a captured batch attends to nothing (its output row is dropped)
            num_blocks = tl.where(token < tl.load(num_real_ptr), num_blocks, 0)
        for i in range(0, num_blocks):
            block = tl.load(tables_ptr + row * stride_table + i).to(tl.int64)
            k = tl.load(k_ptr + block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :])
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where((i * BLOCK + s)[None, :] <= position, scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + block * stride_vb + s[:, None] * stride_vs + kv_head * stride_vh + d[None, :])
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            total = total * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=real[:, None])


def token_paged_attention_triton(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tokens: TokenMetadata, scale: float
) -> torch.Tensor:
    """Paged attention of ``query`` [T, H, D] (see the module docstring); caller checks :func:`supports` first."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    query = query.contiguous()
    out = torch.empty_like(query)
    tables = tokens.block_tables
    _token_attention_kernel[(num_tokens, num_kv_heads)](
        out, query, key_cache, value_cache, tables, tokens.token_seq, tokens.positions,
        tokens.positions if tokens.num_real is None else tokens.num_real, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), tables.stride(0),
        GROUP=group, GROUP_ROWS=max(MIN_DOT, triton.next_power_of_2(group)), HEAD=head_size, BLOCK=block_size,
        IEEE=query.dtype == torch.float32, PADDED=tokens.num_real is not None,
    )
    return out
