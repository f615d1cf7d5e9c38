"""Qwen4-Exp's QSA token selection, in torch: the indexer scores blocks of ``ratio`` consecutive tokens, and each
query attends to the tokens of its ``block_top_k`` best complete blocks plus those after its last complete block.

A block's key is the mean (in fp32) of its tokens' raw indexer keys, which the paged cache holds beside K and V
(``ModelConfig.index_key_dim``), normed and turned by the rotary of the block's first position (the indexer's
module does that: :func:`pooled_block_keys` is the mean). A query ``t``'s score of block ``b`` is
``sum_h relu(q[t, h] . k[b]) / sqrt(D)`` in fp32; a block is complete for ``t`` when its last token is at or before
``t`` (transformers' ``Qwen4ExpTextQSAIndexer``). Equal scores rank by position, the earlier first
(:func:`~lmdeploy.pytorch.kernels.dsa.keep_top_k`), so a prompt's selection does not depend on how it is chunked.
"""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels.dsa import keep_top_k


def context_keys(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, D]``: one sequence's first ``length`` indexer keys, in its ``blocks`` of ``cache [N, B, D]``."""
    return cache.index_select(0, blocks[:-(-length // cache.shape[1])]).flatten(0, 1)[:length]


def pooled_block_keys(keys: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[len(keys) // ratio, D]``: the mean of each complete block of ``ratio`` keys of ``keys [C, D]``, in fp32,
    rounded to their dtype."""
    num_blocks = keys.shape[0] // ratio
    return keys[:num_blocks * ratio].view(num_blocks, ratio, keys.shape[1]).float().mean(1).to(keys.dtype)


def select_tokens(q: torch.Tensor, block_keys: torch.Tensor, q_pos: torch.Tensor, context_len: int, ratio: int,
                  block_top_k: int) -> torch.Tensor:
    """``keep [L, context_len]`` of queries ``q [L, H, D]`` (normed and turned) at positions ``q_pos [L]`` over the
    context's block keys ``[num_blocks, D]`` (normed and turned): each query's ``block_top_k`` best complete blocks
    (all of them where it has no more) and the tokens after its last complete block, up to its own."""
    num_blocks = block_keys.shape[0]
    per_head = torch.relu(torch.matmul(q.float(), block_keys.float().T))
    scores = per_head.sum(-2) / q.shape[-1]**0.5
    q_pos = q_pos.unsqueeze(1)
    complete = (torch.arange(1, num_blocks + 1, device=q.device) * ratio).unsqueeze(0) <= q_pos + 1
    blocks = keep_top_k(scores, complete, block_top_k)
    kv_pos = torch.arange(context_len, device=q.device).unsqueeze(0)
    keep = (kv_pos >= (q_pos + 1) // ratio * ratio) & (kv_pos <= q_pos)
    keep[:, :num_blocks * ratio] |= blocks.repeat_interleave(ratio, dim=1)
    return keep
