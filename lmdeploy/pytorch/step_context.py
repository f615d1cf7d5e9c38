"""What every layer needs to know about the tokens of one engine step."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens in the packed batch.

    ``context_slots`` lists the KV-cache slots of the whole context (cached prefix plus this chunk);
    it is None when the chunk is the whole context, so attention can use the fresh K/V directly.
    """

    start: int
    length: int
    context_slots: torch.Tensor | None


@dataclass
class StepContext:
    """Packed layout of one step: prefill chunks first, then one token per decoding sequence."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    prefill_spans: list[PrefillSpan]
    num_prefill_tokens: int
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
