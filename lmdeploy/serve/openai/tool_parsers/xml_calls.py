"""Tool calls written as XML-style tags, each argument's value as text, between a family's block tags::

    Let me check.<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The function's name goes out once its tag is complete, then the arguments as a JSON object, one parameter at a
time: the value of a parameter whose schema allows only strings streams as it is written, any other comes out
whole once its ``</parameter>`` is seen, typed by the tool's schema (see ``arguments.py``). One newline right
after ``<parameter=...>`` and one right before ``</parameter>`` are the format's, not the value's.
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.text_scan import held_back, skip_whitespace, strip_end
from lmdeploy.serve.openai.tool_parsers.arguments import is_string, json_text, typed_value
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser

NAME = re.compile(r'[^\s<>]+')


class XmlCallsParser(ToolParser):
    """Blocks from ``open_tag`` to ``close_tag`` holding ``<function=NAME>`` calls, among plain text; a family may
    name the call's and the parameter's tags otherwise (``function_tag``, ``function_end``, ``parameter_tag``;
    ``quoted_names``: each name in double quotes, ``<invoke name="NAME">``).

    Whitespace next to a call is dropped. A block that does not start with a function's tag goes back into
    the text as it was, less its tags where they are ``special_markers``. Inside a call, text that is no parameter
    is skipped; a call that the reply leaves open (or that misses ``</parameter>``, ``</function>`` or the
    block's closing tag) ends where the reply (or the next tag) does.
    """

    open_tag: str
    close_tag: str
    function_tag, function_end = '<function=', '</function>'
    parameter_tag, parameter_end = '<parameter=', '</parameter>'
    quoted_names = False

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.state = 'text'
        self.strip = False  # drop the whitespace that follows a call
        self.block_start = 0  # where the block being read started, whitespace before it included
        self.schemas: dict[str, Any] = {}  # the current function's parameters
        self.num_arguments = 0
        self.key = ''
        self.prefix = ''  # what goes before the current value in the arguments: a separator, the key
        self.value_start = 0
        self.searched = 0  # the current value holds no closing tag before this
        self.streaming = False  # the current value streams as a string

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        step = {'text': self._text, 'function': self._function, 'bad': self._bad, 'parameters': self._parameters,
                'value_start': self._value_start, 'value': self._value, 'after_function': self._after_function}
        while step[self.state](out, final):
            pass
        return out

    def _arguments(self, out: ParsedDelta, text: str) -> None:
        out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=text))

    def _text(self, out: ParsedDelta, final: bool) -> bool:
        if self.strip:
            self.pos = skip_whitespace(self.text, self.pos)
            self.strip = self.pos == len(self.text)
        found = self.text.find(self.open_tag, self.pos)
        if found < 0:
            end = len(self.text) if final else strip_end(self.text, self.pos,
                                                          held_back(self.text, self.pos, self.open_tag))
            out.content += self.text[self.pos:end]
            self.pos = max(self.pos, end)
            return False
        self.block_start = strip_end(self.text, self.pos, found)
        out.content += self.text[self.pos:self.block_start]
        self.pos, self.state = found + len(self.open_tag), 'function'
        return True

    def _function(self, out: ParsedDelta, final: bool) -> bool:
        """``<function=NAME>`` starts a call; anything else makes the block text."""
        start = skip_whitespace(self.text, self.pos)
        function = self.function_tag
        head = self.text[start:start + len(function)]
        if head == function:
            close = self.text.find('>', start + len(function))
            name = self.text[start + len(function):close if close >= 0 else len(self.text)]
            if close >= 0:
                name = self._unquoted(name)
            if close >= 0 and NAME.fullmatch(name):
                out.tool_calls.append(self.new_call(name, '{'))
                self.schemas, self.num_arguments = self.parameters.get(name, {}), 0
                self.pos, self.state = close + 1, 'parameters'
                return True
            if close < 0 and not final and (not name or NAME.fullmatch(name)):
                return False
        elif not final and function.startswith(head):
            return False
        self.state = 'bad'
        return True

    def _unquoted(self, name: str) -> str:
        """A complete tag's name less its double quotes, where ``quoted_names`` and it has them."""
        quoted = self.quoted_names and len(name) > 2 and name[0] == name[-1] == '"'
        return name[1:-1] if quoted else name

    def _bad(self, out: ParsedDelta, final: bool) -> bool:
        """A block without a call: back into the text as written (less special tags), up to its closing tag."""
        found = self.text.find(self.close_tag, self.pos)
        if found < 0 and not final:
            return False
        end = len(self.text) if found < 0 else found + len(self.close_tag)
        out.content += self._unmarked(self.block_start, end)
        self.pos, self.state = end, 'text'
        return True

    def _parameters(self, out: ParsedDelta, final: bool) -> bool:
        start = skip_whitespace(self.text, self.pos)
        parameter = self.parameter_tag
        if self.text.startswith(parameter, start):
            close = self.text.find('>', start + len(parameter))
            if close >= 0:
                self.key = self._unquoted(self.text[start + len(parameter):close])
                self.pos, self.state = close + 1, 'value_start'
                return True
            if not final:
                return False
        for tag, state in ((self.function_end, 'after_function'), (self.close_tag, 'text')):
            if self.text.startswith(tag, start):
                self._arguments(out, '}')
                self.pos, self.state, self.strip = start + len(tag), state, True
                return True
        rest = self.text[start:]
        if not final and any(len(rest) < len(tag) and tag.startswith(rest)
                             for tag in (parameter, self.function_end, self.close_tag)):
            return False
        if final and (start == len(self.text) or rest.startswith(parameter)):  # the reply ends inside the call
            self._arguments(out, '}')
            self.cut_call = self.num_calls - 1
            self.pos, self.state = len(self.text), 'text'
            return False
        skip = self.text.find('<', start + 1)  # not a parameter: skipped
        self.pos = len(self.text) if skip < 0 else skip
        return skip >= 0 or final

    def _value_start(self, out: ParsedDelta, final: bool) -> bool:
        if self.pos == len(self.text) and not final:
            return False
        if self.text.startswith('\n', self.pos):
            self.pos += 1
        key = json.dumps(self.key, ensure_ascii=False)
        self.prefix = f'{", " if self.num_arguments else ""}{key}: '
        self.num_arguments += 1
        self.streaming = is_string(self.schemas.get(self.key))
        self.value_start = self.searched = self.pos
        self.state = 'value'
        if self.streaming:
            self._arguments(out, self.prefix + '"')
        return True

    def _value(self, out: ParsedDelta, final: bool) -> bool:
        """The value up to ``</parameter>`` (or a tag that shows it was left open)."""
        tags = (self.parameter_end, self.parameter_tag, self.function_end, self.close_tag)
        start = max(self.pos, self.searched)
        ends = [(found, tag) for tag in tags if (found := self.text.find(tag, start)) >= 0]
        if not ends and not final:
            self.searched = max(start, len(self.text) - max(map(len, tags)))
            if self.streaming:
                end = min(held_back(self.text, self.pos, tag) for tag in tags)
                end -= end > self.pos and self.text[end - 1] == '\n'
                self._stream(out, end)
            return False
        found, tag = min(ends) if ends else (len(self.text), '')
        end = found - (found > self.pos and self.text[found - 1] == '\n')
        if self.streaming:
            self._stream(out, end)
            self._arguments(out, '"')
        else:
            value = typed_value(self.text[self.value_start:end], self.schemas.get(self.key))
            self._arguments(out, self.prefix + json_text(value))
        self.pos = found + (len(tag) if tag == self.parameter_end else 0)
        self.state = 'parameters'
        return True

    def _stream(self, out: ParsedDelta, end: int) -> None:
        if end > self.pos:
            self._arguments(out, json.dumps(self.text[self.pos:end], ensure_ascii=False)[1:-1])
            self.pos = end

    def _after_function(self, out: ParsedDelta, final: bool) -> bool:
        """After a call: the block's closing tag, another call in the same block, or (the tag missing) text."""
        start = skip_whitespace(self.text, self.pos)
        rest = self.text[start:]
        if rest.startswith(self.close_tag):
            self.pos, self.state, self.strip = start + len(self.close_tag), 'text', True
        elif rest.startswith(self.function_tag):
            self.block_start, self.pos, self.state = start, start, 'function'
        elif not final and any(tag.startswith(rest) for tag in (self.close_tag, self.function_tag)):
            return False
        else:
            self.pos, self.state = start, 'text'
        return True
