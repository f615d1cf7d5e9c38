"""What every layer needs to know about the tokens of one engine step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmdeploy.pytorch.multimodal import MultiModalBatch


@dataclass
class StepContext:
    """Packed layout of one step: prefill chunks first, then one token per decoding sequence.

    Token ``i`` stores its K/V at ``(kv_blocks[i], kv_offsets[i])``. Prefill sequence ``s`` owns
    rows ``prefill_q_start[s]:+prefill_q_len[s]`` and has ``prefill_ctx_len[s]`` context tokens in
    the blocks of ``prefill_block_table[s]`` (zero-padded rows) of its ``prefill_seq_len[s]`` tokens
    in all (its whole prompt, and what it generated before a recompute). Decoding sequence ``b`` reads
    ``decode_kv_lens[b]`` tokens in the blocks of ``decode_blocks[b]``. The prefill fields are None
    without prefill chunks, the decode fields without decode tokens. ``rope_positions [3, T]`` replaces
    ``positions`` in the rotary embedding of models with 3-D positions; ``multimodal`` holds the images
    whose placeholder tokens this step feeds.
    """

    positions: torch.Tensor
    kv_blocks: torch.Tensor
    kv_offsets: torch.Tensor
    num_prefill_tokens: int
    prefill_block_table: torch.Tensor | None
    prefill_q_start: torch.Tensor | None
    prefill_q_len: torch.Tensor | None
    prefill_ctx_len: torch.Tensor | None
    prefill_max_q_len: int
    decode_blocks: torch.Tensor | None
    decode_kv_lens: torch.Tensor | None
    prefill_seq_len: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None
    multimodal: MultiModalBatch | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
