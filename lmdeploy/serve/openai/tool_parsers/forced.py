"""Parsers of replies that a tool-call grammar forced (``tool_choice`` ``required`` or a named function).

``required``: a JSON array of ``{"name": ..., "parameters": {...}}`` objects. A named function: the reply
is that function's arguments.
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser
from lmdeploy.serve.openai.tool_parsers.json_calls import JsonCallsParser
from lmdeploy.serve.openai.text_scan import skip_whitespace, strip_end


class RequiredToolParser(JsonCallsParser):
    """``[{"name": ..., "parameters": {...}}, ...]``: each object a call."""

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            start = skip_whitespace(self.text, self.pos)
            if self.state == 'call':
                is_call = self.read_call(out, final)
                if is_call is None:
                    return out
                self.pos, self.state = self.reader.end or len(self.text), 'items' if is_call else 'text'
                continue
            if start == len(self.text) and self.state != 'text':
                return out
            if self.state == 'start':
                if self.text[start] == '[':
                    self.pos, self.state = start + 1, 'items'
                else:
                    self.state = 'text'
            elif self.state == 'items':
                if self.text[start] == ',':
                    self.pos = start + 1
                elif self.text[start] == '{':
                    self.start_call(start)
                else:
                    self.pos, self.state = len(self.text), 'done'
            elif self.state == 'text':
                return self.rest_as_text(out)
            else:
                self.pos = len(self.text)
                return out


class NamedToolParser(ToolParser):
    """The whole reply is the arguments of a call of ``name`` (without the whitespace around them)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        if not self.num_calls:
            self.pos = skip_whitespace(self.text, self.pos)
            if self.pos == len(self.text) and not final:
                return out
            out.tool_calls.append(self.new_call(self.name))
        end = strip_end(self.text, self.pos, len(self.text))
        if end > self.pos:
            out.tool_calls.append(ToolCallDelta(0, arguments=self.text[self.pos:end]))
            self.pos = end
        return out
