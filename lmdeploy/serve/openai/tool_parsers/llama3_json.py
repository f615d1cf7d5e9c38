"""Llama 3.x JSON tool calls: the reply is the call itself, optionally after ``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Several calls are separated by ``;``.
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_calls import JsonCallsParser
from lmdeploy.serve.openai.text_scan import skip_whitespace

PYTHON_TAG = '<|python_tag|>'


@register_tool_parser('llama3_json', 'llama3', 'llama4_json')
class Llama3JsonToolParser(JsonCallsParser):
    """A reply that starts with a JSON object (or ``<|python_tag|>``) is calls; any other is text. Text
    after the calls, or an object that is not a call, is given as text; a ``<|python_tag|>`` that no call
    follows too, less the tag where it is one of ``special_markers``."""

    markers = (PYTHON_TAG,)

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            start = skip_whitespace(self.text, self.pos)
            rest = self.text[start:start + len(PYTHON_TAG)]
            if self.state == 'start':
                if rest.startswith(PYTHON_TAG):
                    self.marker_start, self.pos, self.state = start, start + len(PYTHON_TAG), 'calls'
                elif rest.startswith('{'):
                    self.marker_start, self.state = start, 'calls'
                elif final or (rest and not PYTHON_TAG.startswith(rest)):
                    self.state = 'text'
                else:
                    return out
            elif self.state == 'calls':
                while start < len(self.text) and self.text[start] == ';':
                    start = skip_whitespace(self.text, start + 1)
                if start == len(self.text):
                    if final:
                        self._no_call(out, start)
                    return out
                if self.text[start] != '{':
                    self._no_call(out, start)
                    self.state = 'text'
                    continue
                self.pos = start
                self.start_call(start)
            elif self.state == 'call':
                is_call = self.read_call(out, final)
                if is_call is None:
                    return out
                if not is_call:
                    self._no_call(out, self.pos)
                self.state = 'calls' if is_call else 'text'
            else:
                return self.rest_as_text(out)

    def _no_call(self, out: ParsedDelta, end: int) -> None:
        """Before the first call, the tag (if any) and the text after it up to ``end`` are content; ``pos``
        moves to ``end``."""
        if not self.num_calls:
            out.content += self._unmarked(self.marker_start, end)
        self.pos = max(self.pos, end)
