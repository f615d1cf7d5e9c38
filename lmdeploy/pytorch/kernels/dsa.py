"""DeepSeek Sparse Attention's token selection (DeepSeek-V3.2, GLM-5), in torch: the lightning indexer scores
every context token of each query with its own small keys, and the query attends only to its ``index_topk``
best.

A query ``t``'s score of key ``c`` is ``sum_h w[t, h] * relu(scale * q[t, h] . k[c])`` in fp32 (``w`` the
indexer's per-head weights, ``k`` the per-token indexer keys the cache holds beside the latent). Of the keys up
to its own position a query keeps the ``index_topk`` best, or all of them where there are no more (transformers'
``DeepseekV32Indexer``: its top-k over the causally masked scores; for ties see :func:`keep_top_k`). The
selection is a boolean ``keep`` mask over each query's context, causal already, which the latent attention
(``kernels/mla.py``) applies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenSelection:
    """The keys each query of a step attends: per prefill chunk ``keep [q_len, ctx_len]`` (None without prefill
    chunks), and ``keep [B, N * block_size]`` of the decode rows (None without them)."""

    prefill: list[torch.Tensor] | None
    decode: torch.Tensor | None


def fill_index_keys(keys: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """Writes ``keys [T, D]``; token ``i`` goes to block ``blocks[i]`` at ``offsets[i]`` of ``cache [N, B, D]``."""
    cache[blocks, offsets] = keys.to(cache.dtype)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 ``[..., L, C]`` scores of queries ``q [..., L, H, D]`` with per-head ``weights [..., L, H]`` over
    ``keys [..., C, D]``."""
    per_head = torch.relu(torch.matmul(q.float(), keys.float().unsqueeze(-3).transpose(-1, -2)) * scale)
    return torch.matmul(weights.float().unsqueeze(-2), per_head).squeeze(-2)


def keep_top_k(scores: torch.Tensor, causal: torch.Tensor, top_k: int) -> torch.Tensor:
    """``causal [..., L, C]`` narrowed to each query's ``top_k`` best ``scores`` (all of its keys where it has
    no more). Equal scores rank by position, the earlier first: ``torch.topk`` breaks such ties by the length of
    the row, which differs between a prompt's prefill, its chunks and its decode steps (scores of exactly 0,
    tokens no head's ReLU passes, are common)."""
    masked = scores.masked_fill(~causal, float('-inf'))
    picked = masked.sort(dim=-1, descending=True, stable=True).indices[..., :top_k]
    return torch.zeros_like(causal).scatter_(-1, picked, True) & causal


def prefill_selection(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                      q_start: torch.Tensor, q_len: torch.Tensor, ctx_len: torch.Tensor, top_k: int,
                      scale: float) -> list[torch.Tensor]:
    """Each prefill chunk's ``keep [q_len, ctx_len]``: sequence ``s`` owns rows ``q_start[s]:+q_len[s]`` of
    ``q [T, H, D]`` and ``weights [T, H]``, its context is ``ctx_len[s]`` keys in the blocks of
    ``block_table[s]`` (already holding this chunk's), its chunk the last ``q_len[s]`` of them."""
    block_size = cache.shape[1]
    keeps = []
    for row, (start, length, context_len) in enumerate(zip(q_start.tolist(), q_len.tolist(), ctx_len.tolist())):
        keys = cache.index_select(0, block_table[row, :-(-context_len // block_size)]).flatten(0, 1)[:context_len]
        scores = index_scores(q[start:start + length], weights[start:start + length], keys, scale)
        q_pos = torch.arange(context_len - length, context_len, device=q.device).unsqueeze(1)
        causal = torch.arange(context_len, device=q.device).unsqueeze(0) <= q_pos
        keeps.append(keep_top_k(scores, causal, top_k))
    return keeps


def decode_selection(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                     kv_lens: torch.Tensor, top_k: int, scale: float) -> torch.Tensor:
    """``keep [B, N * block_size]`` of one new token per sequence: ``q [B, H, D]``, ``weights [B, H]`` over the
    ``kv_lens [B]`` keys in the blocks of ``block_table [B, N]`` (the padding past ``kv_lens`` is never kept)."""
    batch, num_blocks = block_table.shape
    keys = cache.index_select(0, block_table.flatten()).view(batch, num_blocks * cache.shape[1], -1)
    scores = index_scores(q.unsqueeze(1), weights.unsqueeze(1), keys, scale).squeeze(1)
    valid = torch.arange(keys.shape[1], device=q.device) < kv_lens.unsqueeze(1)
    return keep_top_k(scores, valid, top_k)
