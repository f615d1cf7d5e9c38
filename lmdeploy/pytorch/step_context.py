"""What every layer needs to know about the tokens of one engine step."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.multimodal import MultiModalBatch

if TYPE_CHECKING:
    from lmdeploy.pytorch.kernels.dsa import TokenSelection


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
    whose placeholder tokens this step feeds. ``prefill_key_limit [num_prefill_tokens]`` (None: causal
    throughout) is the last key position each prefill row attends: its own, or the last of its image's where
    the image's tokens attend to each other both ways (Gemma 3; see ``kernels/attention.py``).
    ``q_scale [T]`` (None: none) is each token's factor on the rotated queries of the layers with
    ``scaled_queries`` (Ministral 3's, see ``nn/rotary.position_query_scale``), set with ``cos`` and ``sin``.

    A model whose sliding-window (or chunked-attention) layers have a KV pool of their own (see
    :class:`BlockManager`, ``PagedAttention.kv_window``) gives those layers ``window_kv_blocks``,
    ``window_prefill_block_table`` and ``window_decode_blocks`` in that pool, in place of ``kv_blocks``,
    ``prefill_block_table`` and ``decode_blocks`` (:meth:`tables`); the entries of the blocks a sliding pool
    gave back read block 0, which the window (or chunk) masks.

    Models with linear-attention layers (see ``paging/state_pool.py``) get, on the host, each prefill chunk's
    ``state_prefill`` entry ``(slot, first row, rows, starts the sequence)`` and, on the device, the decoding
    sequences' recurrent-state slots ``state_decode_slots [num_decode]``; both None for other models.

    ``token_selection`` is the keys the last DeepSeek Sparse Attention layer with an indexer selected this step
    (``kernels/dsa.TokenSelection``), for the layers after it that share its selection (GLM-5's ``shared`` layers).
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
    prefill_key_limit: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    q_scale: torch.Tensor | None = None
    window_kv_blocks: torch.Tensor | None = None
    window_prefill_block_table: torch.Tensor | None = None
    window_decode_blocks: torch.Tensor | None = None
    state_prefill: list[tuple[int, int, int, bool]] | None = None
    state_decode_slots: torch.Tensor | None = None
    token_selection: TokenSelection | None = None

    def tables(self, sliding: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(kv_blocks, prefill_block_table, decode_blocks)`` of a layer, one with a window of keys (sliding or
        chunked) if ``sliding``."""
        if sliding and self.window_kv_blocks is not None:
            return self.window_kv_blocks, self.window_prefill_block_table, self.window_decode_blocks
        return self.kv_blocks, self.prefill_block_table, self.decode_blocks


# Whether the step running now is of decode rows only (True) or prefill rows only (False); None outside a step.
_decode_rows: ContextVar[bool | None] = ContextVar('decode_rows', default=None)


@contextmanager
def step_rows(decode: bool) -> Iterator[None]:
    """The model runs a step of decode rows only (``decode``: one new token of each running sequence) or of
    prefill rows only (prompt chunks) within it; see :func:`small_step`."""
    token = _decode_rows.set(decode)
    try:
        yield
    finally:
        _decode_rows.reset(token)


def small_step(rows: int, bound: int) -> bool:
    """Whether ``rows`` rows run on a layer's kernel for small steps (a 4-bit copy, a GEMV, the LM head's one-row
    copy) rather than its kernel for larger ones. In a step (:func:`step_rows`): whether they are decode rows,
    however many, so that a sequence's decode rows and its prompt rows each take one kernel whatever shares
    their step, and a prompt's output does not depend on its batch (the kernels' arithmetic per row does not
    depend on their number of rows). Outside one (a kernel called on its own): whether they are at most
    ``bound``. Never with a ``bound`` of 0 (no kernel for small steps)."""
    decode = _decode_rows.get()
    return bound > 0 and (rows <= bound if decode is None else decode)
