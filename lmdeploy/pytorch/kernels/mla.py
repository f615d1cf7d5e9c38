"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache, in torch: the CPU path and the
reference for the native and Triton kernels.

A layer's cache is one tensor ``[num_blocks, block_size, D]``: per token its latent ``[:v_dim]``
(``kv_lora_rank`` features, after ``kv_a_layernorm``) then its rotary key ``[v_dim:]``, shared by every
head. The kernels take queries already absorbed into that space (``W_UK`` folded into the non-rotary part
of each head's query, ``q [.., H, D]``): each head's score of a token is ``q . cache[token]``, and its
output the score-weighted sum of the tokens' latents ``cache[token, :v_dim]``, ``[.., H, v_dim]`` (the
layer applies ``W_UV`` after). That is multi-query attention whose value is the first ``v_dim`` features
of the key.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fill_latent_cache(latent: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor,
                      offsets: torch.Tensor) -> None:
    """Writes ``latent [T, D]``; token ``i`` goes to block ``blocks[i]`` at ``offsets[i]``."""
    cache[blocks, offsets] = latent


def _context(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, D]``: one sequence's first ``length`` tokens from its ``blocks``."""
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def mla_prefill_attention(q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                          q_start: torch.Tensor, q_len: torch.Tensor, ctx_len: torch.Tensor, max_q_len: int,
                          scale: float, v_dim: int) -> torch.Tensor:
    """Causal attention of the packed chunks ``q [T, H, D]`` over their contexts; returns ``[T, H, v_dim]``.

    Sequence ``s`` owns rows ``q_start[s]:q_start[s] + q_len[s]`` of ``q`` and of the fresh
    ``latent [T, D]``; its context is ``ctx_len[s]`` tokens in the blocks of ``block_table[s]`` (already
    holding this chunk). A chunk that is its whole context uses the fresh latents directly. ``max_q_len``
    sizes the GPU launch.
    """
    out = q.new_empty(*q.shape[:2], v_dim)
    block_size = cache.shape[1]
    for row, (start, length, context_len) in enumerate(zip(q_start.tolist(), q_len.tolist(), ctx_len.tolist())):
        qt = q[start:start + length].transpose(0, 1).unsqueeze(0)
        if context_len == length:
            kv = latent[start:start + length]
            mask = None
        else:
            kv = _context(cache, block_table[row, :-(-context_len // block_size)], context_len)
            q_pos = torch.arange(context_len - length, context_len, device=q.device).unsqueeze(1)
            mask = torch.arange(context_len, device=q.device).unsqueeze(0) <= q_pos
        kt, vt = kv[None, None], kv[None, None, :, :v_dim]
        chunk = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=True)
        out[start:start + length] = chunk.squeeze(0).transpose(0, 1)
    return out


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
                         scale: float, v_dim: int) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over ``kv_lens [B]`` tokens in ``block_table [B, N]``;
    positions past ``kv_lens`` are masked. Returns ``[B, H, v_dim]``."""
    batch, num_blocks = block_table.shape
    block_size = cache.shape[1]
    kv = cache.index_select(0, block_table.flatten()).view(batch, num_blocks * block_size, -1)
    scores = torch.matmul(q, kv.transpose(1, 2)).float() * scale
    padding = torch.arange(num_blocks * block_size, device=q.device) >= kv_lens.unsqueeze(1)
    scores.masked_fill_(padding.unsqueeze(1), float('-inf'))
    return torch.matmul(scores.softmax(-1).to(q.dtype), kv[..., :v_dim])
