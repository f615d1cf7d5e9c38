"""What every layer needs to know about the tokens of one engine step."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens in the packed batch.

    ``context_blocks`` lists the KV blocks of the whole context (cached prefix plus this chunk,
    ``context_len`` tokens); it is None when the chunk is the whole context, so attention can use
    the fresh K/V directly.
    """

    start: int
    length: int
    context_blocks: torch.Tensor | None
    context_len: int


@dataclass
class StepContext:
    """Packed layout of one step: prefill chunks first, then one token per decoding sequence.

    Token ``i`` stores its K/V at ``(kv_blocks[i], kv_offsets[i])``. Decoding sequences read the
    blocks in the rows of ``decode_blocks``; ``decode_bias`` is 0 on their tokens and -inf on the
    padding after them (None when no row is padded).
    """

    positions: torch.Tensor
    kv_blocks: torch.Tensor
    kv_offsets: torch.Tensor
    prefill_spans: list[PrefillSpan]
    num_prefill_tokens: int
    decode_blocks: torch.Tensor | None
    decode_bias: torch.Tensor | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
