"""gpt-oss's harmony tool calls: a message to ``functions.NAME`` whose body is the arguments::

    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city": "Paris"}<|call|>

It reads the content the harmony reasoning parser leaves (which it always comes with): text, with the
function calls still harmony messages.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.harmony import SPECIAL_TOKENS, HarmonyReader
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser, register_tool_parser


@register_tool_parser('harmony', 'gpt_oss', 'openai')
class HarmonyToolParser(ToolParser):
    """A message to ``functions.NAME`` is a call of NAME, its body the arguments (streamed as written);
    the bodies of other messages and the text outside messages are content."""

    markers = SPECIAL_TOKENS
    reasoning_parser = 'harmony'

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.reader = HarmonyReader()
        self.calling = False

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        for kind, value in self.reader.advance(self.text, final):
            if kind == 'header':
                self.calling = value.function is not None
                if self.calling:
                    out.tool_calls.append(self.new_call(value.function))
            elif kind == 'body' and self.calling:
                out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=value))
            elif kind in ('body', 'text'):
                out.content += value
            else:
                self.calling = False
        self.pos = len(self.text)
        return out
