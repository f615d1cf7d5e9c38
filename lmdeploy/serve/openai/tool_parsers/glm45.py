"""GLM-4.5 and GLM-4.6 tool calls: the function's name, then each argument as a key and a value (strings as
they are, other values in JSON), with or without newlines between the tags::

    Let me check.<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The values are typed by the tools' schemas (see ``arguments.py``): a string parameter's value is its text, and
a value for a parameter the schema does not type is JSON if it reads as JSON (``3``, ``true``, ``[1, 2]``),
else a string. Each call is given out whole once its ``</tool_call>`` is seen. GLM-4.5
reasons in ``<think>`` blocks first (the ``glm45`` reasoning parser).
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.text_scan import WHITESPACE, skip_whitespace
from lmdeploy.serve.openai.tool_parsers.arguments import typed_value
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolParser, register_tool_parser

OPEN, CLOSE = '<tool_call>', '</tool_call>'
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = '<arg_key>', '</arg_key>', '<arg_value>', '</arg_value>'
ARGUMENT = re.compile(r'<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*', re.DOTALL)
NAME = re.compile(r'[^\s<>]+')


def parse_call(body: str, parameters: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of the text between ``<tool_call>`` and ``</tool_call>``, its values typed by
    ``parameters`` (see :attr:`ToolParser.parameters`); None unless it is a name followed by nothing but
    key-value pairs."""
    name, key_open, rest = body.partition(KEY_OPEN)
    name = name.strip(WHITESPACE)
    if not NAME.fullmatch(name):
        return None
    rest, arguments, pos, schemas = key_open + rest, {}, 0, parameters.get(name, {})
    while pos < len(rest):
        match = ARGUMENT.match(rest, pos)
        if match is None:
            return None
        key = match[1].strip(WHITESPACE)
        arguments[key] = typed_value(match[2], schemas.get(key))
        pos = match.end()
    return name, json.dumps(arguments, ensure_ascii=False)


@register_tool_parser('glm45', 'glm4_moe')
class Glm45ToolParser(ToolParser):
    """``<tool_call>`` blocks among plain text; whitespace next to a block is dropped, and a block that holds
    no call goes back into the text as it was, less its tags where they are ``special_markers``."""

    markers = (OPEN, CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.in_call = False
        self.strip = False  # drop the whitespace that follows a block

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if not self.in_call:
                if self.strip:
                    self.pos = skip_whitespace(self.text, self.pos)
                    self.strip = self.pos == len(self.text)
                if not self._content_until(OPEN, final, out):
                    return out
                self.in_call = True
                continue
            found = self.text.find(CLOSE, self.pos)
            if found < 0 and not final:
                return out
            end = len(self.text) if found < 0 else found
            call = parse_call(self.text[self.pos:end], self.parameters)
            if call is None:
                out.content += self._unmarked(self.marker_start, end + (len(CLOSE) if found >= 0 else 0))
            else:
                out.tool_calls.append(self.new_call(*call))
            self.pos = end + (len(CLOSE) if found >= 0 else 0)
            self.in_call, self.strip = False, call is not None

