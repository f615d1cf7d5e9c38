"""Attention over the paged KV cache for a packed batch of prefill chunks and decode tokens."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.kernels import attention, decode_attention, fill_kv_cache, prefill_attention
from lmdeploy.pytorch.kernels.dsa import TokenSelection
from lmdeploy.pytorch.step_context import StepContext


class PagedAttention(nn.Module):
    """Stores this step's K/V in the cache, then attends each token over its context.

    A layer's cache is ``(k_cache, v_cache)``, or with ``quant_policy`` 8 or 4
    ``(k_codes, v_codes, k_scales_zeros, v_scales_zeros)`` (see ``kernels/kv_quant.py``).

    ``sliding_window``, ``attention_chunk``, ``logit_softcap`` and ``sinks`` (None: off) are the attention
    features of ``kernels/attention.py``; ``sinks [num_heads]`` is a parameter filled from the checkpoint when
    ``with_sinks`` is set (this rank's heads under tensor parallelism). A layer with a sliding window or an
    attention chunk (a :attr:`kv_window`) reads the step's sliding-window block tables (``StepContext.tables``).
    Prefill rows attend up to the step's ``prefill_key_limit`` where it has one. A layer that attends over another
    layer's keys and values (``fills_cache=False``: Gemma 3n's KV sharing) is given that layer's cache and the step's
    K/V that layer stored there."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, quant_policy: int = 0,
                 sliding_window: int | None = None, logit_softcap: float | None = None, with_sinks: bool = False,
                 attention_chunk: int | None = None, fills_cache: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.quant_policy = quant_policy
        if sliding_window and attention_chunk:
            raise ValueError('an attention layer takes a sliding window or an attention chunk, not both')
        self.sliding_window = sliding_window or None
        self.attention_chunk = attention_chunk or None
        self.logit_softcap = logit_softcap or None
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if with_sinks else None
        self.fills_cache = fills_cache

    @property
    def kv_window(self) -> int | None:
        """The most positions a query attends, itself included: its sliding window, or its attention chunk (a query
        at p sees from ``floor(p / C) * C``, at most C - 1 before it); None: every position. A layer with one keeps
        its K/V in the sliding-window pool, which gives back the blocks out of the window."""
        return self.sliding_window or self.attention_chunk

    def features(self) -> dict:
        """The feature keywords of the attention kernels, only those that are on."""
        named = {'sliding_window': self.sliding_window, 'attention_chunk': self.attention_chunk,
                 'logit_softcap': self.logit_softcap,
                 'sinks': None if self.sinks is None else self.sinks.float()}
        return {name: value for name, value in named.items() if value is not None}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                ctx: StepContext, selection: TokenSelection | None = None) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, H_kv, D]`` -> ``[T, H * D]``. With ``selection`` (sparse attention: Qwen4-Exp's
        QSA) each query attends only the keys it keeps, in torch (``kernels/attention.py``)."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        quant = (*kv_cache[2:], self.quant_policy) if self.quant_policy else ()
        features = self.features()
        prefill, decode = prefill_attention, decode_attention
        prefill_keep, decode_keep = {}, {}
        if selection is not None:
            prefill, decode = attention.prefill_attention, attention.decode_attention
            prefill_keep, decode_keep = {'keep': selection.prefill}, {'keep': selection.decode}
        kv_blocks, prefill_block_table, decode_blocks = ctx.tables(self.kv_window is not None)
        if self.fills_cache:
            fill_kv_cache(k, v, k_cache, v_cache, kv_blocks, ctx.kv_offsets, *quant)
        num_prefill = ctx.num_prefill_tokens
        parts = []
        if ctx.prefill_q_len is not None:
            key_limit = {} if ctx.prefill_key_limit is None else {'key_limit': ctx.prefill_key_limit}
            parts.append(prefill(q[:num_prefill], k[:num_prefill], v[:num_prefill], k_cache, v_cache,
                                 prefill_block_table, ctx.prefill_q_start, ctx.prefill_q_len, ctx.prefill_ctx_len,
                                 ctx.prefill_max_q_len, self.scale, *quant, **features, **key_limit,
                                 **prefill_keep))
        if decode_blocks is not None:
            parts.append(decode(q[num_prefill:], k_cache, v_cache, decode_blocks, ctx.decode_kv_lens, self.scale,
                                *quant, **features, **decode_keep))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.flatten(1)
