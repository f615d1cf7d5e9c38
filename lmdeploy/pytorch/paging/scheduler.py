"""Continuous batching with chunked prefill and preemption by recompute."""
from __future__ import annotations

from bisect import insort
from collections import deque
from dataclasses import dataclass, field

from lmdeploy.pytorch.engine.sequence import Sequence, SequenceStatus
from lmdeploy.pytorch.paging.block_manager import BlockManager, PrefixMatch
from lmdeploy.pytorch.paging.state_pool import StatePool


@dataclass
class ScheduledSeq:
    """``seq`` feeds ``num_tokens`` new tokens this step, starting at ``seq.num_computed``."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's known tokens, so it yields a token."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefill: list[ScheduledSeq] = field(default_factory=list)
    decode: list[ScheduledSeq] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


def _arrival(seq: Sequence) -> int:
    return seq.seq_id


def recurrent_grain(recurrent_chunk: int, max_prefill_token_num: int, concurrency: int) -> int:
    """Where prefill chunks of a recurrent model end: on multiples of the largest grain, up to ``recurrent_chunk``,
    that a step's budget still holds beside the decode rows of all ``concurrency`` - 1 other sequences (so that
    the earliest arrived sequence in prefill gets a chunk in every step), but at least half the budget (each call
    costs a whole recurrent chunk: a grain of 1 took 13 times the CPU time); 0 without a recurrent chunk. A grain
    below the chunk makes every chunk one grain: the delta rule's rounding follows each call's start."""
    if not recurrent_chunk:
        return 0
    room = max_prefill_token_num - (concurrency - 1)
    return min(recurrent_chunk, max(room, max_prefill_token_num // 2, 1))


class Scheduler:
    """Decides which sequences run in the next step and gives them KV blocks.

    Each step spends a token budget of ``max_prefill_token_num``: running sequences come first
    (one token each when decoding, a chunk when their prompt is still being prefilled), then
    waiting ones in arrival order. ``running`` and the preempted sequences at the head of ``waiting`` keep arrival
    order (``seq_id``, which the engine numbers as requests come), a re-admitted sequence taking back its place. When
    blocks run out, the latest arrived running sequence is preempted (first come, first served, as vLLM's recompute
    policy): a sequence computed again is not the next victim while one that came after it runs, so the oldest
    requests keep progressing; and it comes back only once the blocks for all its tokens are free (or nothing else
    runs), as it would otherwise, the latest arrival, be the next victim again before it has caught up. A preempted
    sequence's blocks are freed and it is recomputed later from its tokens so far: its prompt in prefill chunks,
    then the tokens it generated one a step, each a decode row again (not sampled but for the last), so that every
    token's row runs the kernels it ran first (decode rows and prefill rows may run different ones: GEMVs and
    dequantized GEMMs, the delta rule's recurrent step and its chunked form) and its outputs keep their bits. With
    overlapped steps, a sequence whose last token in flight is its final one is not scheduled again.
    Before a running sequence is scheduled, its blocks out of the sliding window go back to their pool.
    A chunk never ends inside a bidirectional span (``Sequence.bidirectional_spans``): it ends before the span,
    or waits for a step whose budget holds the whole span.

    With LongRoPE (``long_rope_after``: the model's ``original_max_position_embeddings``) a sequence of
    more tokens than that is turned by the long factors throughout, as in transformers: one that grows past
    it while decoding is recomputed the same way, its cache computed again with the long factors, every token
    known then as a prefill row (as transformers' one forward of them all).

    With a ``state_pool`` (models with linear-attention layers) a sequence also takes a recurrent-state slot when
    it is admitted and gives it back with its blocks; a waiting sequence that finds no free slot waits. With a
    ``recurrent_chunk`` (the delta rule's chunk, by which it rounds) where a prefill chunk ends must not depend on
    the other sequences' share of the budget: a chunk that does not end the prompt ends on a multiple of
    ``recurrent_grain`` (see :func:`recurrent_grain`), spanning several grains only where the grain is the
    recurrent chunk itself; a sequence whose next cut the budget left does not reach waits a step.
    """

    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_prefill_token_num: int,
                 long_rope_after: int | None = None, state_pool: StatePool | None = None,
                 recurrent_chunk: int = 0):
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_prefill_token_num = max_prefill_token_num
        self.long_rope_after = long_rope_after
        self.state_pool = state_pool
        self.recurrent_chunk = recurrent_chunk
        concurrency = min(max_batch_size, state_pool.num_slots) if state_pool is not None else max_batch_size
        self.recurrent_grain = recurrent_grain(recurrent_chunk, max_prefill_token_num, concurrency)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_prefill_token_num
        bm = self.block_manager
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.awaiting_final_token or (self._outgrew_short_rope(seq) and seq.num_inflight):
                index += 1
                continue
            if self._outgrew_short_rope(seq):
                seq.prefill_end = seq.num_tokens
                self._requeue(self.running.pop(index))
                continue
            num_tokens = self._chunk_end(seq, seq.num_computed, budget) - seq.num_computed
            if num_tokens == 0:  # a bidirectional span or a recurrent chunk that needs more than the budget left
                index += 1
                continue
            bm.release_out_of_window(seq)
            needed = bm.blocks_needed(seq, seq.num_computed + num_tokens)
            if not self._make_room(index, needed):
                break
            bm.allocate(seq, seq.num_computed + num_tokens)
            item = ScheduledSeq(seq, num_tokens)
            (out.decode if self._generated(seq, seq.num_computed) else out.prefill).append(item)
            budget -= num_tokens
            index += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            seq.long_rope = self._long_rope(seq)
            match = bm.match_prefix(seq)
            num_cached = match.num_blocks * bm.block_size
            num_tokens = self._chunk_end(seq, num_cached, budget) - num_cached
            if num_tokens == 0:
                break
            needed = bm.blocks_needed(seq, num_cached + num_tokens, match)
            if (not bm.can_allocate(needed, match) or not self._room_to_catch_up(seq, match)
                    or (self.state_pool is not None and not self.state_pool.num_free)):
                break
            self.waiting.popleft()
            bm.allocate(seq, num_cached + num_tokens, match)
            if self.state_pool is not None:
                self.state_pool.take(seq)
            seq.num_computed = num_cached
            if seq.num_preemptions == 0:
                seq.num_cached = num_cached
            seq.status = SequenceStatus.RUNNING
            insort(self.running, seq, key=_arrival)
            (out.decode if self._generated(seq, num_cached) else out.prefill).append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        return out

    def _room_to_catch_up(self, seq: Sequence, match: PrefixMatch) -> bool:
        """Whether ``seq``, if it was preempted, may come back: once the blocks for all its tokens are free (or nothing
        else runs), so that it is not preempted again, as the latest arrival, while it catches up."""
        if seq.num_preemptions == 0 or not self.running:
            return True
        return self.block_manager.can_allocate(self.block_manager.blocks_needed(seq, seq.num_tokens, match), match)

    @staticmethod
    def _generated(seq: Sequence, start: int) -> bool:
        """Whether a chunk from ``start`` feeds a token ``seq`` generated (one, a decode row), not its prompt (prefill
        rows, the prompt's last token too when a chunk leaves it alone; see ``Sequence.prefill_end``)."""
        return start >= seq.prefill_end

    def _chunk_end(self, seq: Sequence, start: int, budget: int) -> int:
        """Where the next chunk of ``seq`` from ``start`` ends within ``budget``: never inside a bidirectional span,
        and, with a ``recurrent_grain``, at a multiple of it unless it ends the prompt (with a grain below the
        recurrent chunk, at the next cut or nowhere: ``start``). A preempted sequence's prompt is computed again as a
        prompt, its generated tokens one a step, as decode rows (see :class:`Scheduler`)."""
        limit = seq.prefill_end if start < seq.prefill_end else min(start + 1, seq.num_tokens)
        end = seq.span_start_before(start + min(limit - start, budget))
        grain = self.recurrent_grain
        if not grain:
            return end
        if grain == self.recurrent_chunk:
            return end if end == limit else max(start, end // grain * grain)
        cut = min((start // grain + 1) * grain, limit)
        return cut if end >= cut else start

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its blocks (and its state slot)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def _make_room(self, index: int, needed: list[int]) -> bool:
        """Preempts running sequences after ``index``, latest arrived first, until the ``needed`` blocks of
        every pool are free; if they still are not, preempts the sequence at ``index`` too and returns False. A sequence
        with tokens in flight cannot be recomputed yet, so it is never preempted."""
        bm = self.block_manager
        victim = len(self.running) - 1
        while not bm.can_allocate(needed) and victim > index:
            if self.running[victim].num_inflight == 0:
                self._preempt(self.running.pop(victim))
            victim -= 1
        if bm.can_allocate(needed):
            return True
        if self.running[index].num_inflight == 0:
            self._preempt(self.running.pop(index))
        return False

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Frees the blocks of ``seq`` and puts it back in line by arrival, ahead of every request not yet admitted,
        to be computed again from its tokens."""
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=_arrival)

    def _release(self, seq: Sequence) -> None:
        """Gives back the blocks and the state slot of ``seq``."""
        self.block_manager.free_blocks(seq)
        if self.state_pool is not None:
            self.state_pool.give_back(seq)

    def _long_rope(self, seq: Sequence) -> bool:
        return self.long_rope_after is not None and seq.num_tokens > self.long_rope_after

    def _outgrew_short_rope(self, seq: Sequence) -> bool:
        """Whether ``seq`` has cached tokens turned by LongRoPE's short factors but now needs the long ones."""
        return seq.num_computed > 0 and not seq.long_rope and self._long_rope(seq)
