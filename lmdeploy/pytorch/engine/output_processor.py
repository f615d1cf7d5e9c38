"""Turns sampled tokens into per-request outputs: stop conditions, text deltas, stop words."""
from __future__ import annotations

from dataclasses import dataclass

from lmdeploy.messages import EngineOutput
from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker


class OutputProcessor:
    """Keeps each live request's detokenizer and decides when a request is done."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[int, _TextState] = {}

    def add(self, seq: Sequence) -> None:
        cfg = seq.gen_config
        self.states[seq.seq_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, seq.prompt_ids, cfg.skip_special_tokens, cfg.keep_special_tokens),
            StopChecker(cfg.stop_words, cfg.include_stop_str_in_output))

    def append_token(self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None,
                     session_len: int) -> EngineOutput:
        """Records a sampled token, sets ``seq.finish_reason`` when the request ends, returns its output.

        A token that completes the sequence's grammar ends it as 'stop'; when the grammar allowed nothing
        but a stop token, that token adds no text. Stop words do not apply to text a grammar constrains."""
        cfg = seq.gen_config
        constrained = seq.grammar is not None and seq.grammar.active  # this token was the grammar's choice
        grammar_done = seq.grammar is not None and seq.grammar.accept(token_id, seq.output_ids)
        seq.output_ids.append(token_id)
        state = self.states[seq.seq_id]
        text = ''
        if token_id in seq.stop_ids and (len(seq.output_ids) > cfg.min_new_tokens or grammar_done):
            seq.finish_reason = 'stop'
        else:
            delta = state.detokenizer.step([token_id])
            if constrained:  # the grammar alone decides where its text ends
                text, hit_stop_word = state.stop_checker.flush() + delta, False
            else:
                text, hit_stop_word = state.stop_checker.feed(delta)
            if hit_stop_word or grammar_done:
                seq.finish_reason = 'stop'
            elif len(seq.output_ids) >= cfg.max_new_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= session_len:
                seq.finish_reason = 'length'
        if seq.finish_reason == 'length' or (seq.finish_reason == 'stop' and not state.stop_checker.stopped):
            tail, _ = state.stop_checker.feed(state.detokenizer.finish())
            text += tail + state.stop_checker.flush()
        return self._output(seq, [token_id], text, None if logprobs is None else [logprobs])

    def finish(self, seq: Sequence) -> EngineOutput:
        """The closing output of a request ended from outside (abort or error)."""
        return self._output(seq, [], '', None)

    def _output(self, seq: Sequence, token_ids: list[int], text: str,
                logprobs: list[dict[int, float]] | None) -> EngineOutput:
        if seq.finish_reason is not None:
            self.states.pop(seq.seq_id, None)
        prompt_logprobs = None
        if seq.gen_config.prompt_logprobs is not None and len(seq.output_ids) == len(token_ids) == 1:
            prompt_logprobs = [None, *seq.prompt_logprobs]
        return EngineOutput(seq.seq_id, token_ids, text, logprobs, seq.finish_reason, len(seq.prompt_ids),
                            len(seq.output_ids), seq.num_cached, prompt_logprobs=prompt_logprobs)
