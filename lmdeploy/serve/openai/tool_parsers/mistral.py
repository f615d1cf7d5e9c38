"""Mistral tool calls, after the ``[TOOL_CALLS]`` token: a JSON list of calls (Mistral 7B v0.3, Nemo,
Small 3.1) or, from tokenizer v11 on (Small 3.2, Magistral, Devstral), each call as its name and its
arguments::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}
"""
from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.text_scan import skip_whitespace
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_calls import JsonCallsParser, JsonScanner

TOOL_CALLS, ARGS, CALL_ID = '[TOOL_CALLS]', '[ARGS]', '[CALL_ID]'
_NAME = re.compile(r'\s*([^\s\[]+)\s*(?:' + re.escape(CALL_ID) + r'.*)?', re.DOTALL)


@register_tool_parser('mistral')
class MistralToolParser(JsonCallsParser):
    """Text up to ``[TOOL_CALLS]`` is content (without the whitespace before it); then a list of call
    objects, or calls ``NAME[ARGS]{...}``. A ``[TOOL_CALLS]`` followed by neither, or by a list whose first
    object is not a call, leaves the text as written, less the marker where it is one of ``special_markers``.
    Text after the calls is content too."""

    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.state = 'text'
        self.args: JsonScanner | None = None
        self.sent = 0

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self.state == 'text':
                if not self._content_until(TOOL_CALLS, final, out):
                    return out
                self.state = 'calls'
            elif self.state == 'calls':
                start = skip_whitespace(self.text, self.pos)
                if start == len(self.text) and not final:
                    return out
                if self.text.startswith('[', start):
                    self.pos, self.state, self.first = start + 1, 'items', True
                    continue
                found = self.text.find(ARGS, self.pos)
                if found < 0 and not final:
                    return out
                name = _NAME.fullmatch(self.text, self.pos, found) if found >= 0 else None
                if name is None:  # not a call: text, as written
                    out.content += self._unmarked(self.marker_start, self.pos)
                    self.state = 'text'
                    continue
                out.tool_calls.append(self.new_call(name.group(1)))
                self.pos = self.sent = found + len(ARGS)
                self.args, self.state = JsonScanner(self.pos), 'args'
            elif self.state == 'args':
                end = self.args.advance(self.text)
                upto = self.args.pos if end is None else end
                if upto > self.sent:
                    out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=self.text[self.sent:upto]))
                    self.sent = upto
                if end is None:
                    return out
                self.pos, self.state = end, 'text'
            elif self.state == 'items':
                if not self.read_list_item(out, final, self.first):
                    return out
            elif not self.read_list_call(out, final):
                return out
