"""Paged-KV attention in torch: the CPU path and the reference for the CUDA kernels.

A layer's cache is a pair of tensors ``[num_kv_heads, num_slots, head_dim]``; slot
``block_id * block_size + offset`` holds one token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Writes ``k, v [T, H_kv, D]`` into the cache slots ``slot_mapping [T]``."""
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, context_slots: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal attention of one chunk ``q [L, H, D]`` over its context; returns ``[L, H, D]``.

    Without ``context_slots`` the chunk is the whole context and ``k, v [L, H_kv, D]`` are used;
    otherwise K/V of the cached prefix plus the chunk are read from the cache.
    """
    q_len = q.shape[0]
    qt = q.transpose(0, 1).unsqueeze(0)
    if context_slots is None:
        kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kt = k_cache.index_select(1, context_slots).unsqueeze(0)
        vt = v_cache.index_select(1, context_slots).unsqueeze(0)
        ctx_len = context_slots.shape[0]
        q_pos = torch.arange(ctx_len - q_len, ctx_len).unsqueeze(1)
        mask = torch.arange(ctx_len).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over the slots ``[B, L]``; returns ``[B, H, D]``.

    ``mask [B, 1, 1, L]`` is True where a slot belongs to the sequence (None when all do). The
    query heads of a KV group are laid along the query-length axis, so GQA needs no K/V copy.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    kt = k_cache.index_select(1, slots.flatten()).view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)
    vt = v_cache.index_select(1, slots.flatten()).view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)
    out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)
