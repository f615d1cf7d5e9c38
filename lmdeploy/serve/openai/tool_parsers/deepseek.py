"""DeepSeek-V3 tool calls, between its special tokens; V3 writes the type, the name and the arguments in
a JSON code block, V3.1 the name and the arguments alone::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lmdeploy.serve.openai.text_scan import held_back, skip_whitespace
from lmdeploy.serve.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser, register_tool_parser

CALLS_BEGIN, CALLS_END = '<｜tool▁calls▁begin｜>', '<｜tool▁calls▁end｜>'
CALL_BEGIN, SEP, CALL_END = '<｜tool▁call▁begin｜>', '<｜tool▁sep｜>', '<｜tool▁call▁end｜>'
FENCE, FENCE_END = '```', '\n```'


@register_tool_parser('deepseek_v3', 'deepseek_v31')
class DeepSeekV3ToolParser(ToolParser):
    """Text up to ``<｜tool▁calls▁begin｜>`` is content (without the whitespace before it), then calls up
    to ``<｜tool▁calls▁end｜>``; their arguments stream as written. A ``<｜tool▁calls▁begin｜>`` that no call
    follows leaves the text as written, less the marker where it is one of ``special_markers``."""

    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, SEP, CALL_END)

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special_markers: Collection[str] = ()) -> None:
        super().__init__(tools, special_markers)
        self.state = 'text'
        self.args_end = (CALL_END,)  # what ends the current call's arguments
        self.first = True  # the block's first call is next

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self.state == 'text':
                if not self._content_until(CALLS_BEGIN, final, out):
                    return out
                self.state, self.first = 'calls', True
            elif self.state == 'calls':
                start = skip_whitespace(self.text, self.pos)
                rest = self.text[start:start + len(CALL_BEGIN)]
                for marker, state in ((CALL_BEGIN, 'head'), (CALLS_END, 'text')):
                    if rest.startswith(marker):
                        self.pos, self.state = start + len(marker), state
                        break
                else:
                    if not final and any(m.startswith(rest) for m in (CALL_BEGIN, CALLS_END)):
                        return out
                    if self.first:  # no call in the block: text, as written
                        out.content += self._unmarked(self.marker_start, self.pos)
                    else:  # no call where the next should be: text
                        self.pos = start
                    self.state = 'text'
            elif self.state == 'head':
                if not self._head(out, final):
                    return out
                self.first = False
            elif self.state == 'args':
                found = min((i for m in self.args_end if (i := self.text.find(m, self.pos)) >= 0), default=-1)
                end = found if found >= 0 else len(self.text) if final else min(
                    held_back(self.text, self.pos, m) for m in self.args_end)
                if end > self.pos:
                    out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=self.text[self.pos:end]))
                    self.pos = end
                if found < 0:
                    return out
                self.state = 'tail'
            else:
                found = self.text.find(CALL_END, self.pos)
                if found < 0:
                    return out
                self.pos, self.state = found + len(CALL_END), 'calls'

    def _head(self, out: ParsedDelta, final: bool) -> bool:
        """Reads a call's head up to its arguments (V3: type, name, code fence; V3.1: name); False while
        it is incomplete."""
        sep = self.text.find(SEP, self.pos)
        if sep < 0:
            if final:
                self.state = 'tail'
            return final
        kind = self.text[self.pos:sep].strip()
        if kind != 'function':  # V3.1: the name, then the arguments
            out.tool_calls.append(self.new_call(kind))
            self.pos, self.state, self.args_end = sep + len(SEP), 'args', (CALL_END,)
            return True
        line = self.text.find('\n', sep)
        if line < 0 and not final:
            return False
        line = len(self.text) if line < 0 else line
        after = min(line + 1, len(self.text))  # the line after the name: a code fence or the arguments
        ends = [i for m in ('\n', CALL_END) if (i := self.text.find(m, after)) >= 0]
        end = min(ends) if ends else len(self.text)
        opening = self.text[after:end].lstrip()
        if not ends and not final and (FENCE.startswith(opening) or opening.startswith(FENCE)):
            return False
        out.tool_calls.append(self.new_call(self.text[sep + len(SEP):line].strip()))
        self.pos, self.state, self.args_end = after, 'args', (CALL_END,)
        if opening.startswith(FENCE):
            self.pos, self.args_end = end + self.text.startswith('\n', end), (FENCE_END, CALL_END)
        return True
