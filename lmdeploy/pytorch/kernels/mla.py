"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache, in torch: the CPU path and the
reference for the native and Triton kernels.

A layer's cache is one tensor ``[num_blocks, block_size, D]``: per token its latent ``[:v_dim]``
(``kv_lora_rank`` features, after ``kv_a_layernorm``) then its rotary key ``[v_dim:]``, shared by every
head. The kernels take queries already absorbed into that space (``W_UK`` folded into the non-rotary part
of each head's query, ``q [.., H, D]``): each head's score of a token is ``q . cache[token]``, and its
output the score-weighted sum of the tokens' latents ``cache[token, :v_dim]``, ``[.., H, v_dim]`` (the
layer applies ``W_UV`` after). That is multi-query attention whose value is the first ``v_dim`` features
of the key.

With ``quant_policy`` 8 or 4 (``kv_quant.py``'s scheme) the latent and the rotary key of a token are
quantized each on its own, with a scale and zero point of its own: the cache holds codes
``uint8 [num_blocks, block_size, D * bits // 8]``, the latent's codes then the rotary key's (for int4
each part packed as ``kv_quant.py`` packs a head), and ``scales_zeros`` is
``float32 [num_blocks, block_size, 2, 2]``: ``(scale, min)`` of the latent, then of the rotary key.
Attention over a quantized cache always reads the cache, a chunk's own rows included, dequantized to
``q``'s dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels.kv_quant import dequantize_kv, quantize_kv


def quantize_latent(latent: torch.Tensor, v_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent [..., D]`` -> ``(codes uint8 [..., D * bits // 8], scales_zeros float32 [..., 2, 2])``."""
    parts = [quantize_kv(part, bits) for part in (latent[..., :v_dim], latent[..., v_dim:])]
    return torch.cat([codes for codes, _ in parts], -1), torch.stack([sz for _, sz in parts], -2)


def dequantize_latent(codes: torch.Tensor, scales_zeros: torch.Tensor, v_dim: int, bits: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The rows ``codes`` stand for, ``[..., D]`` in ``dtype``."""
    split = v_dim * bits // 8
    return torch.cat((dequantize_kv(codes[..., :split], scales_zeros[..., 0, :], bits, dtype),
                      dequantize_kv(codes[..., split:], scales_zeros[..., 1, :], bits, dtype)), -1)


def fill_latent_cache(latent: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                      scales_zeros: torch.Tensor | None = None, quant_policy: int = 0, v_dim: int = 0) -> None:
    """Writes ``latent [T, D]``; token ``i`` goes to block ``blocks[i]`` at ``offsets[i]``. A quantized cache
    needs ``v_dim``, where the rotary key starts."""
    if quant_policy:
        latent, scales_zeros[blocks, offsets] = quantize_latent(latent, v_dim, quant_policy)
    cache[blocks, offsets] = latent


def _context(cache: torch.Tensor, scales_zeros: torch.Tensor | None, quant_policy: int, v_dim: int,
             blocks: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """``[length, D]`` in ``dtype``: one sequence's first ``length`` tokens from its ``blocks``."""
    rows = cache.index_select(0, blocks).flatten(0, 1)[:length]
    if not quant_policy:
        return rows
    sz = scales_zeros.index_select(0, blocks).flatten(0, 1)[:length]
    return dequantize_latent(rows, sz, v_dim, quant_policy, dtype)


def mla_prefill_attention(q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                          q_start: torch.Tensor, q_len: torch.Tensor, ctx_len: torch.Tensor, max_q_len: int,
                          scale: float, v_dim: int, scales_zeros: torch.Tensor | None = None,
                          quant_policy: int = 0, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of the packed chunks ``q [T, H, D]`` over their contexts; returns ``[T, H, v_dim]``.

    Sequence ``s`` owns rows ``q_start[s]:q_start[s] + q_len[s]`` of ``q`` and of the fresh
    ``latent [T, D]``; its context is ``ctx_len[s]`` tokens in the blocks of ``block_table[s]`` (already
    holding this chunk). A chunk that is its whole context uses the fresh latents directly, unless the
    cache is quantized. ``max_q_len`` sizes the GPU launch. ``keep`` (sparse attention, ``kernels/dsa.py``): per
    sequence the keys ``[q_len, ctx_len]`` each row attends, causal already.
    """
    out = q.new_empty(*q.shape[:2], v_dim)
    block_size = cache.shape[1]
    for row, (start, length, context_len) in enumerate(zip(q_start.tolist(), q_len.tolist(), ctx_len.tolist())):
        qt = q[start:start + length].transpose(0, 1).unsqueeze(0)
        if context_len == length and not quant_policy and keep is None:
            kv = latent[start:start + length]
            mask = None
        else:
            kv = _context(cache, scales_zeros, quant_policy, v_dim, block_table[row, :-(-context_len // block_size)],
                          context_len, q.dtype)
            q_pos = torch.arange(context_len - length, context_len, device=q.device).unsqueeze(1)
            mask = torch.arange(context_len, device=q.device).unsqueeze(0) <= q_pos if keep is None else keep[row]
        kt, vt = kv[None, None], kv[None, None, :, :v_dim]
        chunk = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=True)
        out[start:start + length] = chunk.squeeze(0).transpose(0, 1)
    return out


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
                         scale: float, v_dim: int, scales_zeros: torch.Tensor | None = None,
                         quant_policy: int = 0, keep: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over ``kv_lens [B]`` tokens in ``block_table [B, N]``;
    positions past ``kv_lens`` are masked, and with ``keep [B, N * block_size]`` (sparse attention) those it
    does not keep. Returns ``[B, H, v_dim]``."""
    batch, num_blocks = block_table.shape
    block_size = cache.shape[1]
    kv = cache.index_select(0, block_table.flatten())
    if quant_policy:
        kv = dequantize_latent(kv, scales_zeros.index_select(0, block_table.flatten()), v_dim, quant_policy, q.dtype)
    kv = kv.view(batch, num_blocks * block_size, -1)
    scores = torch.matmul(q, kv.transpose(1, 2)).float() * scale
    padding = torch.arange(num_blocks * block_size, device=q.device) >= kv_lens.unsqueeze(1)
    if keep is not None:
        padding |= ~keep
    scores.masked_fill_(padding.unsqueeze(1), float('-inf'))
    return torch.matmul(scores.softmax(-1).to(q.dtype), kv[..., :v_dim])
