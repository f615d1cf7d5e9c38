"""gpt-oss's harmony replies: the ``analysis`` channel is reasoning, the other messages content.

A message that calls a function (``to=functions.NAME``) goes into the content as the harmony message it
is, for the harmony tool parser to read (see ``tool_parsers/harmony.py``).
"""
from __future__ import annotations

from lmdeploy.serve.openai.harmony import (CHANNEL, END, MESSAGE, SPECIAL_TOKENS, START, HarmonyReader, Header,
                                           open_header)
from lmdeploy.serve.openai.reasoning_parsers.base import (ReasoningDelta, ReasoningParser,
                                                          register_reasoning_parser)


@register_reasoning_parser('harmony', 'gpt_oss', 'openai_gptoss')
class HarmonyReasoningParser(ReasoningParser):
    """Bodies of ``analysis`` messages are reasoning; bodies of the others (``final``, a ``commentary``
    preamble) and text outside messages are content; function calls pass through whole."""

    end_marker = f'{CHANNEL}final{MESSAGE}'
    markers = SPECIAL_TOKENS
    history_field = 'thinking'  # gpt-oss's template renders it only for a trailing assistant turn

    def __init__(self, prompt: str) -> None:
        super().__init__(prompt)
        self.reader = HarmonyReader(open_header(prompt))
        self.route = 'content'
        self.bodies = 0  # the body events read so far

    def reasoning_enabled(self) -> bool:
        return True

    def _advance(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        for kind, value in self.reader.advance(self.text, final):
            self.bodies += kind == 'body'
            if kind == 'header':
                self.route = _route(value)
                if self.route == 'call':
                    out.content += f'{START}{value.text}{MESSAGE}'
            elif kind == 'body' and self.route == 'reasoning':
                self._reason(out, *self.reader.body_spans[self.bodies - 1])
            elif kind in ('body', 'text'):
                out.content += value
            elif self.route == 'call':
                out.content += value or END
        return out


def _route(header: Header) -> str:
    if header.function is not None:
        return 'call'
    return 'reasoning' if header.channel == 'analysis' else 'content'
