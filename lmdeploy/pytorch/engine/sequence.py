"""The engine's view of one request: its tokens, its KV blocks and its progress."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lmdeploy.messages import FinishReason, GenerationConfig
from lmdeploy.pytorch.multimodal import MultiModalInput

if TYPE_CHECKING:  # xgrammar behind it takes ~0.5 s to import, which a tensor-parallel worker never needs
    from lmdeploy.pytorch.engine.guided import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class Sequence:
    """One generation request inside the engine.

    ``num_computed`` counts the tokens whose K/V already sit in the cache; the tokens after it are
    fed to the model in the next step that schedules this sequence. ``multimodal`` lists the
    prompt's images; models with 3-D rotary positions (Qwen-VL) give the prompt's positions in
    ``rope_positions [3, len(prompt_ids)]``, and later tokens sit at their index plus ``rope_delta``.

    ``block_ids`` is its block table in the KV cache's first pool, ``window_block_ids`` in the sliding-window
    layers' pool of a model that also has full-attention layers; a sliding pool's table holds None for the
    blocks it gave back (see :class:`BlockManager`).
    ``num_inflight`` counts tokens already sampled on the device whose ids have not reached the host
    yet (overlapped scheduling): they count in ``num_tokens`` but are not in ``output_ids``.
    ``awaiting_final_token`` is set when the token in flight is the last one the request may get.
    ``grammar`` constrains the tokens it may sample (``GenerationConfig.response_format``).
    ``prompt_logprobs[j]`` is the logprob entry of prompt token ``j + 1``, from the logits at position ``j``.
    ``bidirectional_spans`` are the ``[start, end)`` token spans whose tokens attend to each other both ways
    (Gemma 3's images): one step computes each whole, so no prefill chunk or prefix-cache hit ends inside one.
    ``state_slot`` is its row in the recurrent-state pool of a model with linear-attention layers (see
    ``paging/state_pool.py``), None while it holds none.
    ``num_preemptions`` counts the times its cache was dropped to be computed again; ``long_rope`` says
    that its cache is turned by LongRoPE's long factors (see :class:`Scheduler`). The tokens before
    ``prefill_end`` are computed as prefill rows, again too when the cache is dropped: the prompt's, and all
    those known when LongRoPE's switch recomputed the sequence (as transformers' one forward of them all).
    """

    seq_id: int
    prompt_ids: list[int]
    gen_config: GenerationConfig
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int | None] = field(default_factory=list)
    window_block_ids: list[int | None] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    long_rope: bool = False
    multimodal: list[MultiModalInput] = field(default_factory=list)
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    num_inflight: int = 0
    awaiting_final_token: bool = False
    grammar: GrammarState | None = None
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    state_slot: int | None = None
    prefill_end: int = field(init=False)

    def __post_init__(self):
        self.prefill_end = len(self.prompt_ids)
        if not self.gen_config.is_greedy:
            self.generator = torch.Generator()
            seed = self.gen_config.random_seed
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far, those still in flight included."""
        return len(self.output_ids) + self.num_inflight

    @property
    def num_pending(self) -> int:
        """Tokens not yet fed to the model."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def stop_ids(self) -> set[int]:
        """Token ids that end generation (EOS unless ignored, plus ``stop_token_ids``)."""
        ids = set(self.gen_config.stop_token_ids or ())
        if not self.gen_config.ignore_eos:
            ids |= self.eos_token_ids
        return ids

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """The positions in ``[start, end)`` whose logits give prompt logprobs not yet recorded."""
        if self.gen_config.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, len(self.prompt_ids) - 1))

    def span_start_before(self, position: int) -> int:
        """``position``, or the first token of the bidirectional span it falls inside (past that first token):
        where a chunk or a cached prefix that would end at ``position`` ends instead."""
        for start, end in self.bidirectional_spans:
            if start < position < end:
                return start
        return position

    def key_limits(self, start: int, end: int) -> list[int]:
        """The last key position each of tokens ``start:end`` attends: its own, or the last of its bidirectional
        span's (see ``StepContext.prefill_key_limit``)."""
        limits = list(range(start, end))
        for span_start, span_end in self.bidirectional_spans:
            for position in range(max(start, span_start), min(end, span_end)):
                limits[position - start] = span_end - 1
        return limits

    def rope_positions_of(self, start: int, end: int) -> torch.Tensor:
        """``[3, end - start]`` 3-D rotary positions of tokens ``start:end``."""
        if self.rope_positions is None:
            return torch.arange(start, end).expand(3, -1)
        num_prompt = self.rope_positions.shape[1]
        tail = torch.arange(min(max(start, num_prompt), end), end) + self.rope_delta
        return torch.cat((self.rope_positions[:, start:end], tail.expand(3, -1)), dim=1)

    def block_key(self, start: int, size: int) -> tuple:
        """What identifies the tokens ``[start, start + size)`` in the prefix cache: their ids and, when
        images overlap them, each image's hash and offset, so the same text with another image differs;
        and whether LongRoPE's long factors turn them."""
        tokens = tuple(self.token_ids[start:start + size])
        images = tuple((m.content_hash, m.offset - start) for m in self.multimodal
                       if m.offset < start + size and m.end > start)
        key = (tokens, images) if images else tokens
        return (key, 'long rope') if self.long_rope else key
