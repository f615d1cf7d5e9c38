"""``<think>...</think>`` reasoning, as Qwen3, QwQ, DeepSeek-R1 and GLM-4.5 write it.

Qwen3 opens the block in its reply (or, with ``enable_thinking=False``, its template closes an empty
block in the prompt); DeepSeek-R1's template opens it in the prompt, so the reply starts inside it.
"""
from __future__ import annotations

from lmdeploy.serve.openai.reasoning_parsers.base import (ReasoningDelta, ReasoningParser,
                                                          register_reasoning_parser)
from lmdeploy.serve.openai.text_scan import WHITESPACE, held_back, skip_whitespace

START, END = '<think>', '</think>'


def _prompt_state(prompt: str) -> str:
    """'open' when the prompt ends inside a think block, 'closed' when it ends with one, else 'none'."""
    tail = prompt.rstrip(WHITESPACE)
    if tail.rfind(START) > tail.rfind(END):
        return 'open'
    return 'closed' if tail.endswith(END) else 'none'


@register_reasoning_parser('qwen3', 'deepseek_r1', 'deepseek-r1', 'think')
class ThinkReasoningParser(ReasoningParser):
    """The reply is reasoning up to ``</think>`` when the prompt opened the block or the reply starts
    with ``<think>``; otherwise all of it is content. Whitespace right after ``</think>`` is dropped."""

    end_marker = END

    def __init__(self, prompt: str) -> None:
        super().__init__(prompt)
        self.state = {'open': 'reasoning', 'closed': 'content', 'none': 'start'}[_prompt_state(prompt)]
        self.strip = False

    def reasoning_enabled(self) -> bool:
        return _prompt_state(self.prompt) != 'closed'

    def _advance(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while True:
            if self.state == 'start':
                start = skip_whitespace(self.text, self.pos)
                rest = self.text[start:start + len(START)]
                if rest == START:
                    self.pos, self.state = start + len(START), 'reasoning'
                elif final or (rest and not START.startswith(rest)):
                    self.state = 'content'
                else:
                    return out
            elif self.state == 'reasoning':
                found = self.text.find(END, self.pos)
                if found < 0:
                    end = len(self.text) if final else held_back(self.text, self.pos, END)
                    out.reasoning += self.text[self.pos:end]
                    self.pos = max(self.pos, end)
                    return out
                out.reasoning += self.text[self.pos:found]
                self.pos, self.state, self.strip = found + len(END), 'content', True
            else:
                if self.strip:
                    self.pos = skip_whitespace(self.text, self.pos)
                    self.strip = self.pos == len(self.text)
                out.content += self.text[self.pos:]
                self.pos = len(self.text)
                return out


@register_reasoning_parser('glm45', 'glm4_moe')
class Glm45ReasoningParser(ThinkReasoningParser):
    """GLM-4.5's and GLM-4.6's ``<think>`` reasoning (``enable_thinking=False`` closes an empty block in the
    prompt), keeping the tags in the text should a tokenizer mark them special."""

    special_tokens = (START, END)
