"""Hermes-style tool calls, as Qwen2.5 and Qwen3 write them::

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and LongCat-Flash's, the same blocks in ``<longcat_tool_call>`` tags.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolParser, register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_calls import CallReader
from lmdeploy.serve.openai.text_scan import held_back, skip_whitespace, strip_end

OPEN, CLOSE = '<tool_call>', '</tool_call>'


@register_tool_parser('hermes', 'qwen', 'qwen2d5', 'qwen3')
class HermesToolParser(ToolParser):
    """``<tool_call>`` blocks holding one JSON call each, among plain text.

    Whitespace next to a block is dropped; a block that holds no call, or a tag that the reply ends on, goes back
    into the text as it was, less the tags where they are ``special_markers`` (Qwen2.5's and Qwen3's tokenizers
    make them added tokens that are not special).
    """

    open_tag, close_tag = OPEN, CLOSE
    markers = (OPEN, CLOSE)

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.state = 'text'
        self.strip = False  # drop the whitespace that follows a block
        self.block_start = 0
        self.reader: CallReader | None = None

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self.state == 'text':
                if self.strip:
                    self.pos = skip_whitespace(self.text, self.pos)
                    self.strip = self.pos == len(self.text)
                found = self.text.find(self.open_tag, self.pos)
                if found < 0:
                    out.content += self._text(final)
                    return out
                text_end = strip_end(self.text, self.pos, found)
                out.content += self.text[self.pos:text_end]
                # a block that holds no call goes back as written, the whitespace before it included
                self.block_start, self.pos, self.state = text_end, found + len(self.open_tag), 'block'
            elif self.state == 'block':
                start = skip_whitespace(self.text, self.pos)
                if start == len(self.text):
                    if final:
                        out.content += self._unmarked(self.block_start, start)
                        self.pos, self.state = start, 'text'
                    return out
                self.reader, self.pos = CallReader(start), start
                self.state = 'call' if self.text[start] == '{' else 'bad'
            elif self.state == 'call':
                deltas, is_call = self.reader.advance(self, final)
                out.tool_calls += deltas
                if is_call is None:
                    return out
                self.pos = self.reader.end or len(self.text)
                self.state = 'tail' if is_call else 'bad'
            elif self.state == 'tail':
                end = self._block_end(final, self.text.find(self.open_tag, self.pos))
                if end is None:
                    return out
                self.pos, self.state, self.strip = end, 'text', True
            else:
                end = self._block_end(final)
                if end is None:
                    return out
                out.content += self._unmarked(self.block_start, end)
                self.pos, self.state = end, 'text'

    def _block_end(self, final: bool, next_open: int = -1) -> int | None:
        """Where the block ends: after its closing tag, or where the next block opens (a model that left
        its block open); None while that is unknown."""
        found = self.text.find(self.close_tag, self.pos)
        if 0 <= next_open and (found < 0 or next_open < found):
            return next_open
        if found >= 0:
            return found + len(self.close_tag)
        return len(self.text) if final else None

    def _text(self, final: bool) -> str:
        """The text from ``pos``: all of it at the end; before then, up to trailing whitespace or a tag
        that may be starting."""
        if final:
            end = strip_end(self.text, self.pos, len(self.text)) if self.num_calls else len(self.text)
        else:
            end = strip_end(self.text, self.pos, held_back(self.text, self.pos, self.open_tag))
        text, self.pos = self.text[self.pos:end], max(self.pos, end)
        return text


@register_tool_parser('longcat')
class LongcatToolParser(HermesToolParser):
    """LongCat-Flash's calls: Hermes blocks in ``<longcat_tool_call>`` tags."""

    open_tag, close_tag = '<longcat_tool_call>', '</longcat_tool_call>'
    markers = (open_tag, close_tag)
