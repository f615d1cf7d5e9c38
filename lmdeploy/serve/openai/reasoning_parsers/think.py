"""``<think>...</think>`` reasoning, as Qwen3, QwQ, DeepSeek-R1 and GLM-4.5 write it, Seed-OSS's
``<seed:think>...</seed:think>`` and Mistral's ``[THINK]...[/THINK]``.

Qwen3 opens the block in its reply (or, with ``enable_thinking=False``, its template closes an empty
block in the prompt); DeepSeek-R1's and Qwen3.5's templates open it in the prompt, so the reply starts inside
it, as Seed-OSS's does with a thinking budget of 0.
"""
from __future__ import annotations

from lmdeploy.serve.openai.reasoning_parsers.base import (ReasoningDelta, ReasoningParser,
                                                          register_reasoning_parser)
from lmdeploy.serve.openai.text_scan import WHITESPACE, held_back, skip_whitespace, strip_end

START, END = '<think>', '</think>'


def _prompt_state(prompt: str, start: str, end: str) -> str:
    """'open' when the prompt ends inside a block from ``start`` to ``end``, 'closed' when it ends with one,
    else 'none'."""
    tail = prompt.rstrip(WHITESPACE)
    if tail.rfind(start) > tail.rfind(end):
        return 'open'
    return 'closed' if tail.endswith(end) else 'none'


@register_reasoning_parser('qwen3', 'deepseek_r1', 'deepseek-r1', 'think', 'glm45', 'glm4_moe')
class ThinkReasoningParser(ReasoningParser):
    """The reply is reasoning up to ``</think>`` when the prompt opened the block or the reply starts
    with ``<think>``; otherwise all of it is content. Whitespace right after ``</think>`` is dropped.
    ``start_marker`` and ``end_marker`` are the block's tags; an ``implicit_ends`` tag in the reasoning ends it
    too, and starts the content. GLM-4.5's and GLM-4.6's ``enable_thinking=False`` closes an empty block in
    the prompt, as Qwen3's does."""

    start_marker = START
    end_marker = END
    markers = (START, END)
    implicit_ends: tuple[str, ...] = ()

    def __init__(self, prompt: str) -> None:
        super().__init__(prompt)
        self.state = {'open': 'reasoning', 'closed': 'content', 'none': 'start'}[self._prompt_state()]
        self.strip = False

    def _prompt_state(self) -> str:
        return _prompt_state(self.prompt, self.start_marker, self.end_marker)

    def reasoning_enabled(self) -> bool:
        return self._prompt_state() != 'closed'

    def grammar_opener(self) -> str | None:
        return self.start_marker if self._prompt_state() == 'none' else None

    def _advance(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while True:
            if self.state == 'start':
                start = skip_whitespace(self.text, self.pos)
                rest = self.text[start:start + len(self.start_marker)]
                if rest == self.start_marker:
                    self.pos, self.state = start + len(self.start_marker), 'reasoning'
                elif final or (rest and not self.start_marker.startswith(rest)):
                    self.state = 'content'
                else:
                    return out
            elif self.state == 'reasoning':
                ends = (self.end_marker, *self.implicit_ends)
                found = [(i, tag) for tag in ends if (i := self.text.find(tag, self.pos)) >= 0]
                if not found:
                    end = len(self.text) if final else min(held_back(self.text, self.pos, tag) for tag in ends)
                    self._reason(out, self.pos, end)
                    self.pos = max(self.pos, end)
                    return out
                at, tag = min(found)
                self._reason(out, self.pos, at)
                self.state, self.strip = 'content', tag == self.end_marker
                self.pos = at + len(tag) if self.strip else at
            else:
                self._content(out, final)
                return out

    def _content(self, out: ReasoningDelta, final: bool) -> None:
        """Gives out the content from ``pos``, without the whitespace right after the reasoning."""
        if self.strip:
            self.pos = skip_whitespace(self.text, self.pos)
            self.strip = self.pos == len(self.text)
        out.content += self.text[self.pos:]
        self.pos = len(self.text)


@register_reasoning_parser('qwen3_5')
class Qwen35ReasoningParser(ThinkReasoningParser):
    """Qwen3.5's ``<think>`` reasoning (its template opens the block in the prompt), which may go straight into a
    ``<tool_call>`` without closing the block: the call ends the reasoning."""

    implicit_ends = ('<tool_call>',)


@register_reasoning_parser('seed_oss')
class SeedOssReasoningParser(ThinkReasoningParser):
    """Seed-OSS's ``<seed:think>`` reasoning (a thinking budget of 0 opens the block in the prompt, and the
    reply closes it at once)."""

    start_marker, end_marker = '<seed:think>', '</seed:think>'
    markers = (start_marker, end_marker)


@register_reasoning_parser('mistral', 'magistral')
class MistralReasoningParser(ThinkReasoningParser):
    """Magistral's and Mistral Small 4's ``[THINK]...[/THINK]`` reasoning (special tokens; Small 4 reasons where
    its template's ``reasoning_effort`` asks), which a ``[TOOL_CALLS]`` may follow."""

    start_marker, end_marker = '[THINK]', '[/THINK]'
    markers = (start_marker, end_marker)


class AnswerBlockReasoningParser(ThinkReasoningParser):
    """Reasoning, then the answer in a block whose tags are ``answer_tags``: the content is the answer without
    those tags and the whitespace next to them (text outside the block stays)."""

    answer_tags: tuple[str, ...] = ()

    def _content(self, out: ReasoningDelta, final: bool) -> None:
        while True:
            if self.strip:
                self.pos = skip_whitespace(self.text, self.pos)
                self.strip = self.pos == len(self.text)
            found = [(i, tag) for tag in self.answer_tags if (i := self.text.find(tag, self.pos)) >= 0]
            if not found:
                end = len(self.text) if final else strip_end(
                    self.text, self.pos, min(held_back(self.text, self.pos, tag) for tag in self.answer_tags))
                out.content += self.text[self.pos:end]
                self.pos = max(self.pos, end)
                return
            at, tag = min(found)
            out.content += self.text[self.pos:strip_end(self.text, self.pos, at)]
            self.pos, self.strip = at + len(tag), True


@register_reasoning_parser('hunyuan_a13b', 'hunyuan')
class HunyuanReasoningParser(AnswerBlockReasoningParser):
    """Hunyuan-A13B's and Hunyuan dense's ``<think>`` reasoning, then ``<answer>...</answer>``."""

    answer_tags = ('<answer>', '</answer>')
    markers = (START, END, *answer_tags)


@register_reasoning_parser('cohere2', 'command_a', 'command_r7b')
class CohereReasoningParser(AnswerBlockReasoningParser):
    """Command R7B's and Command A's ``<|START_THINKING|>`` reasoning (or tool plan), then the answer in
    ``<|START_RESPONSE|>...<|END_RESPONSE|>`` (Command A Reasoning: ``<|START_TEXT|>...<|END_TEXT|>``)."""

    start_marker, end_marker = '<|START_THINKING|>', '<|END_THINKING|>'
    answer_tags = ('<|START_RESPONSE|>', '<|END_RESPONSE|>', '<|START_TEXT|>', '<|END_TEXT|>')
    markers = (start_marker, end_marker, *answer_tags)
