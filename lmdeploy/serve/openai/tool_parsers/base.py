"""What every tool parser is: a stateful splitter of one choice's content into text and tool calls.

A parser is fed the content as it is generated (:meth:`ToolParser.feed`) and flushed at the end
(:meth:`ToolParser.finish`); each call returns a :class:`ParsedDelta`. Parsers decide only on text
they have seen in full, so the deltas of any chunking of the same text add up to the same message:
a non-streaming answer is the one-chunk case.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmdeploy.serve.openai.registry import Registry
from lmdeploy.serve.openai.text_scan import held_back, strip_end
from lmdeploy.serve.openai.tool_parsers.arguments import parameter_schemas


def tool_call_id() -> str:
    return f'call_{uuid.uuid4().hex[:24]}'


@dataclass
class ToolCallDelta:
    """A piece of tool call ``index``: its first piece carries ``id`` and ``name``, later ones more
    ``arguments`` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ''


@dataclass
class ParsedDelta:
    """New plain text and new tool-call pieces."""

    content: str = ''
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ToolParser(ABC):
    """Splits one choice's content into text and tool calls, fed piecewise.

    ``tools`` are the request's OpenAI ``tools``: ``self.parameters`` holds each function's parameters'
    schemas, for the parsers of formats that write arguments as untyped text. Subclasses keep the whole
    content in ``self.text`` and a read position ``self.pos``; :meth:`_advance` consumes what can be decided
    (with ``final``: everything). ``markers`` are the tags the parser reads: the detokenizer keeps those that
    the served tokenizer makes special tokens in the reply's text; ``reasoning_parser`` names the reasoning
    parser whose content the parser reads, when it needs one.

    ``special_markers`` are the markers that the reply's text would leave out without a parser: those the
    served tokenizer makes special tokens, when the request skips special tokens (none otherwise). Text that
    holds no call (a marker that starts none, a block without a call) is content as that text shows it: as
    written, less the ``special_markers`` (:meth:`_unmarked`).
    """

    markers: tuple[str, ...] = ()
    reasoning_parser: str | None = None

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        self.parameters = parameter_schemas(tools)
        self.special_markers = frozenset(special_markers)
        self.text = ''
        self.pos = 0
        self.num_calls = 0
        self.cut_call: int | None = None  # a call the reply ended inside, which the parser closed itself
        # the last marker :meth:`_content_until` found: where the whitespace before it starts, where it starts, ends
        self.marker_start = 0

    def feed(self, text: str) -> ParsedDelta:
        """The delta that ``text``, appended to the content, makes certain."""
        self.text += text
        return self._advance(False)

    def finish(self) -> ParsedDelta:
        """The rest, once the content is complete."""
        return self._advance(True)

    def parse(self, text: str) -> ParsedDelta:
        """All of a complete content at once."""
        return self.feed(text).extend(self.finish())

    def new_call(self, name: str, arguments: str = '') -> ToolCallDelta:
        """The first piece of the next tool call."""
        self.num_calls += 1
        return ToolCallDelta(self.num_calls - 1, tool_call_id(), name, arguments)

    def _content_until(self, marker: str, final: bool, out: ParsedDelta) -> bool:
        """Moves the text from ``pos`` up to ``marker`` into ``out.content`` (without the whitespace before
        it, from ``marker_start`` on) and ``pos`` past it: True. Without the marker: the text that cannot be
        its start, False."""
        found = self.text.find(marker, self.pos)
        if found < 0:
            end = len(self.text) if final else strip_end(self.text, self.pos, held_back(self.text, self.pos, marker))
            out.content += self.text[self.pos:end]
            self.pos = max(self.pos, end)
            return False
        self.marker_start = strip_end(self.text, self.pos, found)
        out.content += self.text[self.pos:self.marker_start]
        self.pos = found + len(marker)
        return True

    def _unmarked(self, start: int, end: int, markers: Sequence[str] | None = None) -> str:
        """The text from ``start`` to ``end`` less those of ``markers`` (default: all the parser's) that are
        ``special_markers``, which the reply's text would not show without a parser."""
        text = self.text[start:end]
        for marker in self.markers if markers is None else markers:
            if marker in self.special_markers:
                text = text.replace(marker, '')
        return text

    @abstractmethod
    def _advance(self, final: bool) -> ParsedDelta:
        """Consumes ``self.text`` from ``self.pos`` as far as it is certain (all of it when ``final``)."""


TOOL_PARSERS: Registry[ToolParser] = Registry('tool call parser')
register_tool_parser = TOOL_PARSERS.register
get_tool_parser = TOOL_PARSERS.lookup
