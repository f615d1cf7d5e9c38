"""Paged-KV attention in torch: the CPU path and the reference for the CUDA kernels.

A layer's cache is a pair of tensors ``[num_blocks, num_kv_heads, block_size, head_dim]``; with
``quant_policy`` 8 or 4 they hold codes, and ``k_scales_zeros, v_scales_zeros`` their scales and zero
points (``kv_quant.py``). Attention over a quantized cache dequantizes what it reads to ``q``'s dtype
and always reads the cache, the chunk's own K/V included, so that a prompt attends over the same values
whether its prefix came from the prefix cache, an earlier chunk or this one.

Four optional features, off by default (None), take the same names in every kernel set:
``sliding_window`` W: a token attends to the last W positions, itself included (transformers' masking),
and in prefill those after it up to its key limit (below);
``attention_chunk`` C: a token at position p attends only to keys in its own chunk of positions,
``[floor(p / C) * C, p]`` (Llama 4's chunked layers); a layer has a window or a chunk, not both
(:func:`first_key` is the lower key bound of either);
``logit_softcap`` c: scores become ``c * tanh(scores / c)`` before the softmax (Gemma 2);
``sinks [H]`` fp32: a learned logit per query head that joins the softmax denominator and adds no value
(gpt-oss).
Prefill also takes ``key_limit [T]`` int: the last key position each query row may attend, at or past its own
(None: its own, causal attention). Gemma 3's image tokens attend to every token of their image, the later ones
included (transformers: the causal mask OR "same image block"): each one's limit is its image's last position.
Both take ``keep`` (sparse attention, Qwen4-Exp's QSA in ``kernels/qsa.py``): the keys each query attends, causal
already (prefill: per chunk ``[q_len, ctx_len]``; decode: ``[B, N * block_size]``); torch only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels.kv_quant import dequantize_kv, quantize_kv


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  blocks: torch.Tensor, offsets: torch.Tensor, k_scales_zeros: torch.Tensor | None = None,
                  v_scales_zeros: torch.Tensor | None = None, quant_policy: int = 0) -> None:
    """Writes ``k, v [T, H_kv, D]``; token ``i`` goes to block ``blocks[i]`` at ``offsets[i]``."""
    if quant_policy:
        k, k_scales_zeros[blocks, :, offsets] = quantize_kv(k, quant_policy)
        v, v_scales_zeros[blocks, :, offsets] = quantize_kv(v, quant_policy)
    k_cache[blocks, :, offsets] = k
    v_cache[blocks, :, offsets] = v


def first_key(q_pos: torch.Tensor, sliding_window: int | None, attention_chunk: int | None) -> torch.Tensor:
    """The first key position a query at ``q_pos`` attends to: the start of its sliding window, of its attention
    chunk, or 0 (it may be negative, which reads as 0)."""
    if sliding_window:
        return q_pos - sliding_window + 1
    if attention_chunk:
        return q_pos // attention_chunk * attention_chunk
    return torch.zeros_like(q_pos)


def _blocks(cache: torch.Tensor, scales_zeros: torch.Tensor | None, ids: torch.Tensor, quant_policy: int,
            dtype: torch.dtype) -> torch.Tensor:
    """The cache blocks ``ids``, ``[len(ids), H_kv, block_size, D]`` in ``dtype``."""
    blocks = cache.index_select(0, ids)
    if not quant_policy:
        return blocks
    return dequantize_kv(blocks, scales_zeros.index_select(0, ids), quant_policy, dtype)


def _gather_context(blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``[H_kv, length, D]``: one sequence's first ``length`` tokens from its ``blocks``."""
    num_kv_heads, head_dim = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :length]


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of fp32 ``scores``; ``sinks``, shaped as ``scores[..., 0]`` or to
    broadcast to it, join the denominator."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().unsqueeze(-1).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), -1).softmax(-1)[..., :-1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            logit_softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``q [H, L, D]`` over ``k, v [H_kv, C, D]`` where ``allowed [L, C]``, scores in fp32 -> ``[H, L, D]``."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if logit_softcap:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    scores = scores.masked_fill(~allowed, float('-inf'))
    return torch.matmul(_softmax(scores, None if sinks is None else sinks.view(-1, 1)).to(q.dtype), v)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_table: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                      ctx_len: torch.Tensor, max_q_len: int, scale: float, k_scales_zeros: torch.Tensor | None = None,
                      v_scales_zeros: torch.Tensor | None = None, quant_policy: int = 0,
                      sliding_window: int | None = None, logit_softcap: float | None = None,
                      sinks: torch.Tensor | None = None, key_limit: torch.Tensor | None = None,
                      attention_chunk: int | None = None, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of the packed chunks ``q [T, H, D]`` over their contexts; returns ``[T, H, D]``.

    Sequence ``s`` owns rows ``q_start[s]:q_start[s] + q_len[s]`` of ``q`` and of the fresh
    ``k, v [T, H_kv, D]``; its context is ``ctx_len[s]`` tokens in the blocks of ``block_table[s]``
    (already holding this chunk). A chunk that is its whole context uses the fresh K/V directly,
    unless the cache is quantized.
    ``max_q_len`` sizes the GPU launch; here each sequence is one SDPA call, or, with soft-capping or
    sinks, plain matmuls and softmax.
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[2]
    features = bool(sliding_window or attention_chunk or logit_softcap or sinks is not None or key_limit is not None
                    or keep is not None)
    for row, (start, length, context_len) in enumerate(zip(q_start.tolist(), q_len.tolist(), ctx_len.tolist())):
        qt = q[start:start + length].transpose(0, 1).unsqueeze(0)
        if context_len == length and not quant_policy and not features:
            kt = k[start:start + length].transpose(0, 1).unsqueeze(0)
            vt = v[start:start + length].transpose(0, 1).unsqueeze(0)
            chunk = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:
            blocks = block_table[row, :-(-context_len // block_size)]
            kt = _gather_context(_blocks(k_cache, k_scales_zeros, blocks, quant_policy, q.dtype), context_len)
            vt = _gather_context(_blocks(v_cache, v_scales_zeros, blocks, quant_policy, q.dtype), context_len)
            kt, vt = kt.unsqueeze(0), vt.unsqueeze(0)
            q_pos = torch.arange(context_len - length, context_len, device=q.device).unsqueeze(1)
            kv_pos = torch.arange(context_len, device=q.device).unsqueeze(0)
            last = q_pos if key_limit is None else key_limit[start:start + length].unsqueeze(1)
            mask = (kv_pos <= last) & (kv_pos >= first_key(q_pos, sliding_window, attention_chunk))
            if keep is not None:
                mask &= keep[row]
            if logit_softcap or sinks is not None:
                chunk = _attend(qt[0], kt[0], vt[0], mask, scale, logit_softcap, sinks).unsqueeze(0)
            else:
                chunk = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + length] = chunk.squeeze(0).transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float, k_scales_zeros: torch.Tensor | None = None,
                     v_scales_zeros: torch.Tensor | None = None, quant_policy: int = 0,
                     sliding_window: int | None = None, logit_softcap: float | None = None,
                     sinks: torch.Tensor | None = None, attention_chunk: int | None = None,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over ``kv_lens [B]`` tokens in ``block_table [B, N]``.

    Scores are computed block by block on the gathered blocks, so K/V are never copied into a
    contiguous layout; positions past ``kv_lens`` are masked. Returns ``[B, H, D]``.
    """
    batch, num_heads, head_dim = q.shape
    num_blocks = block_table.shape[1]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    ids = block_table.flatten()
    shape = (batch, num_blocks, num_kv_heads, block_size, head_dim)
    k = _blocks(k_cache, k_scales_zeros, ids, quant_policy, q.dtype).view(shape)
    v = _blocks(v_cache, v_scales_zeros, ids, quant_policy, q.dtype).view(shape)
    qg = q.view(batch, 1, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2))
    scores = scores.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group, -1).float() * scale
    if logit_softcap:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    kv_pos = torch.arange(num_blocks * block_size, device=q.device)
    q_pos = kv_lens.unsqueeze(1) - 1
    padding = (kv_pos > q_pos) | (kv_pos < first_key(q_pos, sliding_window, attention_chunk))
    if keep is not None:
        padding |= ~keep
    scores.masked_fill_(padding[:, None, None, :], float('-inf'))
    sinks = None if sinks is None else sinks.view(num_kv_heads, group)
    probs = _softmax(scores, sinks).to(q.dtype).view(batch, num_kv_heads, group, num_blocks, block_size)
    out = torch.matmul(probs.permute(0, 3, 1, 2, 4), v).sum(1)
    return out.reshape(batch, num_heads, head_dim)
