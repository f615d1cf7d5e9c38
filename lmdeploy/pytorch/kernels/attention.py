"""Paged-KV attention in torch: the CPU path and the reference for the CUDA kernels.

A layer's cache is a pair of tensors ``[num_blocks, num_kv_heads, block_size, head_dim]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """Writes ``k, v [T, H_kv, D]``; token ``i`` goes to block ``blocks[i]`` at ``offsets[i]``."""
    k_cache[blocks, :, offsets] = k
    v_cache[blocks, :, offsets] = v


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``[H_kv, length, D]``: one sequence's first ``length`` cached tokens."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[3]
    return cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :length]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, context_blocks: torch.Tensor | None, context_len: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of one chunk ``q [L, H, D]`` over its context; returns ``[L, H, D]``.

    Without ``context_blocks`` the chunk is the whole context and ``k, v [L, H_kv, D]`` are used;
    otherwise K/V of the cached prefix plus the chunk are read from the cache.
    """
    q_len = q.shape[0]
    qt = q.transpose(0, 1).unsqueeze(0)
    if context_blocks is None:
        kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kt = _gather_context(k_cache, context_blocks, context_len).unsqueeze(0)
        vt = _gather_context(v_cache, context_blocks, context_len).unsqueeze(0)
        q_pos = torch.arange(context_len - q_len, context_len).unsqueeze(1)
        mask = torch.arange(context_len).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over the blocks ``block_table [B, N]``.

    Scores are computed block by block on the gathered blocks, so K/V are never copied into a
    contiguous layout; ``bias [B, N * block_size]`` masks the padding. Returns ``[B, H, D]``.
    """
    batch, num_heads, head_dim = q.shape
    num_blocks = block_table.shape[1]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = k_cache.index_select(0, block_table.flatten()).view(batch, num_blocks, num_kv_heads, block_size, head_dim)
    v = v_cache.index_select(0, block_table.flatten()).view(batch, num_blocks, num_kv_heads, block_size, head_dim)
    qg = q.view(batch, 1, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2))
    scores = scores.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group, -1).float() * scale
    if bias is not None:
        scores = scores + bias[:, None, None, :]
    probs = scores.softmax(-1).to(q.dtype).view(batch, num_kv_heads, group, num_blocks, block_size)
    out = torch.matmul(probs.permute(0, 3, 1, 2, 4), v).sum(1)
    return out.reshape(batch, num_heads, head_dim)
