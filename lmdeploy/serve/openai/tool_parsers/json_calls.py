"""Reading tool-call JSON objects, ``{"name": ..., "arguments": {...}}``, from text that grows."""
from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.text_scan import skip_whitespace
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser

_STRING = r'"(?:[^"\\]|\\.)*"'


def _head(name_key: str) -> re.Pattern[str]:
    """The head of a call whose name (under ``name_key``, after the call's id where Cohere writes one) comes first
    and whose arguments are an object: the name is then known before the arguments are written, and they can
    stream."""
    return re.compile(rf'\{{\s*(?:"tool_call_id"\s*:\s*{_STRING}\s*,\s*)?"{name_key}"\s*:\s*({_STRING})\s*,\s*'
                      r'"(?:arguments|parameters)"\s*:\s*(?=\{)')


_HEADS = {name_key: _head(name_key) for name_key in ('name', 'tool_name')}
_SPECIAL = re.compile(r'[{}\[\]"\\<]')
_ARGUMENT_KEYS = ('arguments', 'parameters')


class JsonScanner:
    """Finds the end of the JSON object or array that starts at ``start`` of a text that grows.

    ``pos`` is how far the text has been read; ``end`` (once known) is the index after the closing
    bracket. A ``<`` outside a string, which no JSON holds (the start of a closing tag), ends it too.
    """

    def __init__(self, start: int):
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        """Reads the new part of ``text``; returns ``end`` once known."""
        while self.end is None:
            m = _SPECIAL.search(text, self.pos)
            if m is None:
                self.pos = len(text)
                break
            c, self.pos = m.group(), m.end()
            if self.in_string:
                if c == '\\':
                    if self.pos == len(text):  # the escaped character is still to come
                        self.pos -= 1
                        break
                    self.pos += 1
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in '{[':
                self.depth += 1
            elif c in '}]':
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
            elif c == '<':
                self.end = self.pos = m.start()
        return self.end


def _string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:
        return None


def call_of(text: str, name_key: str = 'name') -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a complete call object in any key order, its name under ``name_key``, or None
    if it is not one."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # nested deeper than Python's json reads: no call either
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str):
        return None
    args = next((obj[k] for k in _ARGUMENT_KEYS if obj.get(k) is not None), {})
    return obj[name_key], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class CallReader:
    """Reads the call object that starts at ``start`` of ``parser.text``.

    Once its head (``{"name": "...", "arguments": `` or ``"parameters": ``) is complete the call's name
    goes out, then its arguments as the model writes them, raw, up to the end of their object. A call
    written otherwise is read whole, then given at once with its arguments re-serialised. ``name_key`` is the
    objects' key of the function's name (``"name"``, or Cohere's ``"tool_name"``).
    """

    def __init__(self, start: int, name_key: str = 'name'):
        self.start = start
        self.name_key = name_key
        self.object = JsonScanner(start)
        self.args: JsonScanner | None = None
        self.index = -1
        self.sent = start

    @property
    def end(self) -> int | None:
        """Where the object ends, once known."""
        return self.object.end

    def advance(self, parser: ToolParser, final: bool) -> tuple[list[ToolCallDelta], bool | None]:
        """The call's new pieces, and whether the object is a call: None while that is still open."""
        text, out = parser.text, []
        end = self.object.advance(text)
        if self.args is None:
            head = _HEADS[self.name_key].match(text, self.start)
            name = _string(head.group(1)) if head else None
            if name is not None:
                out.append(parser.new_call(name))
                self.index, self.sent = out[-1].index, head.end()
                self.args = JsonScanner(head.end())
        if self.args is not None:
            args_end = self.args.advance(text)
            upto = self.args.pos if args_end is None else args_end
            if upto > self.sent:
                out.append(ToolCallDelta(self.index, arguments=text[self.sent:upto]))
                self.sent = upto
            return out, True if end is not None or final else None
        if end is None and not final:
            return out, None
        call = call_of(text[self.start:end], self.name_key)
        if call is None:
            return out, False
        out.append(parser.new_call(*call))
        return out, True


class JsonCallsParser(ToolParser):
    """A parser of replies that hold call objects: ``state`` says what it reads next (``'start'`` first,
    ``'call'`` while ``reader`` reads a call object); ``name_key`` is the objects' key of the function's name."""

    name_key = 'name'

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.state = 'start'
        self.reader: CallReader | None = None
        self.first = True  # in a list of calls: its first object is next

    def start_call(self, start: int) -> None:
        """Reads the object at ``start`` as a call from now on."""
        self.reader, self.state = CallReader(start, self.name_key), 'call'

    def read_list_item(self, out: ParsedDelta, final: bool, first: bool) -> bool:
        """In a list of calls: past a comma, into the next object, or, at the list's end or anything else, back to
        ``'text'``; False where the text ends first. A ``first`` item that is no object makes the list text, from
        the whitespace before its marker on (``marker_start``), less the marker where it is a special marker."""
        start = skip_whitespace(self.text, self.pos)
        c = self.text[start] if start < len(self.text) else None
        if c is None and not (final and first):
            return False
        if c == ',':
            self.pos = start + 1
        elif c == '{':
            self.start_call(start)
        elif first:
            out.content += self._unmarked(self.marker_start, start)
            self.pos, self.state = start, 'text'
        else:
            self.pos, self.state = start + (c == ']'), 'text'
        return c is not None

    def read_call(self, out: ParsedDelta, final: bool) -> bool | None:
        """Adds the call's new pieces to ``out``; whether the object is a call (None while that is open).
        Once it is one, ``pos`` moves past it."""
        deltas, is_call = self.reader.advance(self, final)
        out.tool_calls += deltas
        if is_call:
            self.pos = self.reader.end or len(self.text)
        return is_call

    def read_list_call(self, out: ParsedDelta, final: bool) -> bool:
        """A list's object (state ``'call'``): past it to ``'items'`` where it is a call, else back to ``'text'``
        from the object on (from the marker on where it is the list's first); False while it is still open."""
        is_call = self.read_call(out, final)
        if is_call is None:
            return False
        if is_call:
            self.first, self.state = False, 'items'
            return True
        if self.first:
            out.content += self._unmarked(self.marker_start, self.reader.start)
        self.pos, self.state = self.reader.start, 'text'
        return True

    def rest_as_text(self, out: ParsedDelta) -> ParsedDelta:
        """``out`` with the unread text added as content."""
        out.content += self.text[self.pos:]
        self.pos = len(self.text)
        return out
