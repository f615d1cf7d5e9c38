"""Pythonic tool calls, as Llama 4 (with its pythonic chat template), Llama 3.2 and others write them: a
Python list of calls with keyword arguments, optionally between ``<|python_start|>`` and ``<|python_end|>``::

    [get_weather(city="Paris", days=3), now()]

LFM2 writes the same lists between ``<|tool_call_start|>`` and ``<|tool_call_end|>`` (parser ``lfm2``).

The values are Python literals (JSON's ``true``, ``false`` and ``null`` are read too), parsed with ``ast``,
never evaluated.
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.text_scan import held_back, skip_whitespace, strip_end
from lmdeploy.serve.openai.tool_parsers.arguments import is_value, json_text, literal
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser, register_tool_parser

PYTHON_START, PYTHON_END = '<|python_start|>', '<|python_end|>'
LFM2_START, LFM2_END = '<|tool_call_start|>', '<|tool_call_end|>'
CALL_HEAD = re.compile(r'\s*([A-Za-z_][\w.]*)\s*\(')
HEAD_PREFIX = re.compile(r'\s*(?:[A-Za-z_][\w.]*\s*)?')  # what the start of a call's head looks like
ARGUMENT = re.compile(r'\s*([A-Za-z_]\w*)\s*=(.*)', re.DOTALL)


class ArgumentScanner:
    """Finds the end of the argument that starts at ``start`` of a text that grows: the ``,`` or ``)`` (or a
    stray closing bracket) outside brackets and string literals."""

    def __init__(self, start: int):
        self.pos = start
        self.depth = 0
        self.quote = ''

    def advance(self, text: str) -> int | None:
        """Reads the new part of ``text``; the index of the argument's end once known."""
        while self.pos < len(text):
            c = text[self.pos]
            if self.quote:
                if c == '\\':
                    if self.pos + 1 == len(text):
                        return None
                    self.pos += 2
                    continue
                rest = text[self.pos:self.pos + len(self.quote)]
                if rest == self.quote:
                    self.pos, self.quote = self.pos + len(self.quote), ''
                    continue
                if c == self.quote[0] and self.quote.startswith(rest):  # maybe the closing quotes, cut
                    return None
            elif c in '\'"':
                rest = text[self.pos:self.pos + 3]
                if len(rest) < 3 and (c * 3).startswith(rest):  # '' or the start of '''
                    return None
                self.quote = c * 3 if rest == c * 3 else c
                self.pos += len(self.quote)
                continue
            elif c in '([{':
                self.depth += 1
            elif c in ')]}':
                if self.depth == 0:
                    return self.pos
                self.depth -= 1
            elif c == ',' and self.depth == 0:
                return self.pos
            self.pos += 1
        return None


def _argument(text: str) -> tuple[str, str] | None:
    """``(name, value JSON)`` of ``name=literal``; None otherwise."""
    match = ARGUMENT.fullmatch(text)
    value = literal(match[2].strip()) if match else None
    return (match[1], json_text(value)) if match and is_value(value) else None


@register_tool_parser('pythonic', 'llama4_pythonic')
class PythonicToolParser(ToolParser):
    """A list of calls at the reply's start, at a line's start, or after ``<|python_start|>``; the text before
    it is content (without the whitespace before it), and so is the text after it.

    A call's name goes out once its first argument (or its ``)``) is read and holds; its arguments then go
    out one by one. A list whose first call does not hold (``[1, 2]``, ``[f(x)]``) is text; a call that breaks
    off later keeps the arguments before the break, and the rest of the reply is text. A call that the reply
    leaves open ends with it. A ``<|python_start|>`` that no list follows is left out of the text where it is
    one of ``special_markers``.
    """

    start_marker, end_marker = PYTHON_START, PYTHON_END  # the markers a list of calls may come between
    markers = (start_marker, end_marker)

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.state = 'text'
        self.scan = 0  # where the search for a list goes on
        self.call_start = 0  # where the current call's text starts (the list's, for a list's first call)
        self.resume = 0  # where the search for a list goes on should the current call be text
        self.name = ''
        self.called = False  # the current call went out
        self.num_arguments = 0
        self.scanner = ArgumentScanner(0)

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        step = {'text': self._text, 'call': self._call, 'after_call': self._after_call,
                'after_list': self._after_list}
        while step[self.state](out, final):
            pass
        return out

    def _line_start(self, at: int) -> bool:
        before = strip_end(self.text, 0, at)
        return before == 0 or '\n' in self.text[before:at] or self.text.endswith(self.start_marker, 0, before)

    def _text(self, out: ParsedDelta, final: bool) -> bool:
        while (at := self.text.find('[', self.scan)) >= 0:
            if not self._line_start(at):
                self.scan = at + 1
                continue
            head = CALL_HEAD.match(self.text, at + 1)
            waiting = head is None and not final and HEAD_PREFIX.match(self.text, at + 1).end() == len(self.text)
            if head is None and not waiting:
                self.scan = at + 1
                continue
            start = strip_end(self.text, self.pos, at)
            if self.text.endswith(self.start_marker, self.pos, start):
                start = strip_end(self.text, self.pos, start - len(self.start_marker))
            out.content += self._unmarked(self.pos, start, (self.start_marker, ))
            self.pos, self.scan = start, at
            if waiting:
                return False
            self._start_call(self.pos, head)
            return True
        end = len(self.text)
        if not final:  # a list may follow the whitespace or a (possibly cut) <|python_start|> at the end
            end = strip_end(self.text, self.pos, held_back(self.text, self.pos, self.start_marker))
            if self.text.endswith(self.start_marker, self.pos, end):
                end = strip_end(self.text, self.pos, end - len(self.start_marker))
        out.content += self._unmarked(self.pos, end, (self.start_marker, ))  # a whole marker: held back till then
        self.pos = max(self.pos, end)
        self.scan = max(self.scan, held_back(self.text, self.scan, self.start_marker))
        return False

    def _start_call(self, start: int, head: re.Match) -> None:
        self.call_start, self.resume = start, head.start(1)
        self.name, self.called, self.num_arguments = head[1], False, 0
        self.pos, self.state = head.end(), 'call'
        self.scanner = ArgumentScanner(self.pos)

    def _call(self, out: ParsedDelta, final: bool) -> bool:
        """The current call's next argument (``pos`` is its start)."""
        end = self.scanner.advance(self.text)
        if end is None and not final:
            return False
        text = self.text[self.pos:len(self.text) if end is None else end]
        argument = _argument(text)
        if end is None:  # the reply ends inside the call
            if argument is None and not self.called:
                return self._not_a_call()
            self._put(out, argument)
            self._close(out)
            self.cut_call = self.num_calls - 1
            self.pos = self.scan = len(self.text)
            self.state = 'text'
            return True
        mark = self.text[end]
        if mark not in ',)' or (argument is None and not (mark == ')' and not text.strip())):
            if not self.called:
                return self._not_a_call()
            self._close(out)  # the call breaks off before this argument, which is text
            self.state, self.scan = 'text', self.pos
            return True
        self._put(out, argument)
        self.pos = end + 1
        if mark == ')':
            self._close(out)
            self.state = 'after_call'
        else:
            self.scanner = ArgumentScanner(self.pos)
        return True

    def _not_a_call(self) -> bool:
        """The current call's text is content; the search for a list goes on after its head's start."""
        self.pos, self.scan, self.state = self.call_start, self.resume, 'text'
        return True

    def _put(self, out: ParsedDelta, argument: tuple[str, str] | None) -> None:
        """The call's name (the first time) and ``argument``, if any."""
        if not self.called:
            out.tool_calls.append(self.new_call(self.name, '{'))
            self.called = True
        if argument is not None:
            key = json.dumps(argument[0], ensure_ascii=False)
            separator = ', ' if self.num_arguments else ''
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=f'{separator}{key}: {argument[1]}'))
            self.num_arguments += 1

    def _close(self, out: ParsedDelta) -> None:
        out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments='}'))

    def _after_call(self, out: ParsedDelta, final: bool) -> bool:
        """After a call: ``,`` and the next call, or the list's end."""
        start = skip_whitespace(self.text, self.pos)
        if start == len(self.text):
            return False
        if self.text[start] == ',':
            head = CALL_HEAD.match(self.text, start + 1)
            if head is not None:
                self._start_call(start + 1, head)
                return True
            if not final and HEAD_PREFIX.match(self.text, start + 1).end() == len(self.text):
                return False
        self.pos = self.scan = start + 1 if self.text[start] == ']' else start
        self.state = 'after_list'
        return True

    def _after_list(self, out: ParsedDelta, final: bool) -> bool:
        """The whitespace and the end marker (``<|python_end|>``) after a list are dropped."""
        start = skip_whitespace(self.text, self.pos)
        rest = self.text[start:start + len(self.end_marker)]
        if rest == self.end_marker:
            start += len(self.end_marker)
        elif not final and self.end_marker.startswith(rest):
            return False
        self.pos = self.scan = start
        self.state = 'text'
        return True


@register_tool_parser('lfm2')
class Lfm2ToolParser(PythonicToolParser):
    """LFM2's pythonic calls, between ``<|tool_call_start|>`` and ``<|tool_call_end|>``: :class:`PythonicToolParser`
    with those markers."""

    start_marker, end_marker = LFM2_START, LFM2_END
    markers = (start_marker, end_marker)
