"""Tool calls as a JSON list of call objects after an opening tag, closed by a tag or not::

    some text<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]
    </tool_calls>

Granite (no closing tag), Jamba, Hunyuan and Falcon-H1 write their calls so.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.text_scan import held_back, skip_whitespace, strip_end
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta
from lmdeploy.serve.openai.tool_parsers.json_calls import JsonCallsParser


class JsonListToolParser(JsonCallsParser):
    """Text up to an opening tag (one of ``open_tags``) is content, without the whitespace before it; then a list
    of call objects, whose arguments stream as written, and ``close_tag`` (when the format has one) with the
    whitespace after it. A tag that no list of calls follows, an object that is not a call (with what follows
    it), and the text after the list are content, less the tags where they are ``special_markers``. With
    ``single_calls`` a tag may hold one call object instead of a list."""

    open_tags: tuple[str, ...] = ()
    close_tag: str | None = None
    single_calls = False

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.state = 'text'
        self.in_list = True

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
                opening = self.text[start] if start < len(self.text) else None
                self.first, self.in_list = True, opening == '['
                if opening == '[':
                    self.pos, self.state = start + 1, 'items'
                elif opening == '{' and self.single_calls:
                    self.start_call(start)
                else:  # no list: the tag is text
                    out.content += self._unmarked(self.marker_start, start)
                    self.pos, self.state = start, 'text'
            elif self.state == 'items':
                start = skip_whitespace(self.text, self.pos)
                if not self.first and self.text.startswith(']', start):
                    self.pos, self.state = start + 1, 'close'
                elif not self.read_list_item(out, final, self.first):
                    return out
            elif self.state == 'close':
                if not self._close(final):
                    return out
            elif not self.read_list_call(out, final):
                return out
            elif self.state == 'items' and not self.in_list:
                self.state = 'close'

    def _close(self, final: bool) -> bool:
        """Past the closing tag and the whitespace after it (then back to ``'text'``): False while the text
        may still be going to hold it."""
        if self.close_tag is None:
            self.state = 'text'
            return True
        start = skip_whitespace(self.text, self.pos)
        rest = self.text[start:start + len(self.close_tag)]
        if rest == self.close_tag:
            end = skip_whitespace(self.text, start + len(rest))
            if end == len(self.text) and not final:
                return False
            self.pos, self.state = end, 'text'
        elif final or not self.close_tag.startswith(rest) or start + len(rest) < len(self.text):
            self.state = 'text'  # no closing tag: what follows the list is text
        else:
            return False
        return True

    def _text(self, out: ParsedDelta, final: bool) -> bool:
        """Content up to the next opening tag (then True), or as far as no tag may be starting."""
        found = [(i, m) for m in self.open_tags if (i := self.text.find(m, self.pos)) >= 0]
        if not found:
            end = len(self.text) if final else strip_end(
                self.text, self.pos, min(held_back(self.text, self.pos, m) for m in self.open_tags))
            out.content += self.text[self.pos:end]
            self.pos = max(self.pos, end)
            return False
        at, marker = min(found)
        self.marker_start = strip_end(self.text, self.pos, at)
        out.content += self.text[self.pos:self.marker_start]
        self.pos, self.state = at + len(marker), 'marker'
        return True
