"""Granite 3 tool calls: ``<|tool_call|>`` (a special token of Granite 3.0; Granite 3.1 on write the text
``<tool_call>``) and a JSON list of calls::

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.text_scan import held_back, skip_whitespace, strip_end
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_calls import JsonCallsParser

MARKERS = ('<|tool_call|>', '<tool_call>')


@register_tool_parser('granite')
class GraniteToolParser(JsonCallsParser):
    """Text up to a marker is content (without the whitespace before it); then a list of call objects, whose
    arguments stream as written. A marker that no list of calls follows, an object that is not a call (with
    what follows it), and the text after the list are content, less the marker where it is one of
    ``special_markers``."""

    markers = MARKERS

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.state = 'text'
        self.first = True  # the list's first object is next

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self.state == 'text':
                if not self._text(out, final):
                    return out
            elif self.state == 'marker':
                start = skip_whitespace(self.text, self.pos)
                if start == len(self.text) and not final:
                    return out
                if start < len(self.text) and self.text[start] == '[':
                    self.pos, self.state, self.first = start + 1, 'items', True
                else:  # no list: the marker is text
                    out.content += self._unmarked(self.marker_start, start)
                    self.pos, self.state = start, 'text'
            elif self.state == 'items':
                if not self.read_list_item(out, final, self.first):
                    return out
            else:
                is_call = self.read_call(out, final)
                if is_call is None:
                    return out
                if not is_call:  # an object that is no call: text, from the marker on if it is the list's first
                    if self.first:
                        out.content += self._unmarked(self.marker_start, self.reader.start)
                    self.pos, self.state = self.reader.start, 'text'
                    continue
                self.first = False
                self.state = 'items'

    def _text(self, out: ParsedDelta, final: bool) -> bool:
        """Content up to the next marker (then True), or as far as no marker may be starting."""
        found = [(i, m) for m in MARKERS if (i := self.text.find(m, self.pos)) >= 0]
        if not found:
            end = len(self.text) if final else strip_end(
                self.text, self.pos, min(held_back(self.text, self.pos, m) for m in MARKERS))
            out.content += self.text[self.pos:end]
            self.pos = max(self.pos, end)
            return False
        at, marker = min(found)
        self.marker_start = strip_end(self.text, self.pos, at)
        out.content += self.text[self.pos:self.marker_start]
        self.pos, self.state = at + len(marker), 'marker'
        return True
