"""One choice's reply as an assistant message: reasoning, then content with its tool calls, built
piece by piece while it streams (or at once), in OpenAI's message and delta shapes."""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from lmdeploy.serve.openai.protocol import ChatMessage, FunctionCall, ToolCall
from lmdeploy.serve.openai.reasoning_parsers import ReasoningParser
from lmdeploy.serve.openai.text_scan import MarkerFilter
from lmdeploy.serve.openai.tool_parsers import ToolCallDelta, ToolParser
from lmdeploy.serve.reasoning import ReasoningCounter
from lmdeploy.tokenizer import IncrementalDetokenizer


@dataclass
class MessageDelta:
    """New reasoning text, content text and tool-call pieces of a reply."""

    reasoning: str = ''
    content: str = ''
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceParser:
    """Splits one choice's reply: ``reasoning`` (if any) takes the reasoning out, ``tools`` (if any) the
    tool calls out of the content; calls beyond ``max_calls`` are dropped. ``special_markers`` (the parsers'
    markers that the reply's text would leave out without a parser, see :class:`ToolParser`) that the parsers
    leave in the reasoning or the content, a stray ``</tool_call>`` say, are left out of them too."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 max_calls: int | None = None, special_markers: Collection[str] = ()):
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        self.reasoning_filter, self.content_filter = MarkerFilter(special_markers), MarkerFilter(special_markers)
        self.arguments: dict[int, list[str]] = {}  # the pieces of each call's arguments given out so far

    @property
    def num_calls(self) -> int:
        """The tool calls given out so far."""
        made = self.tools.num_calls if self.tools else 0
        return made if self.max_calls is None else min(made, self.max_calls)

    def feed(self, text: str, final: bool = False) -> MessageDelta:
        """The new pieces that ``text``, the next part of the reply, makes certain; with ``final`` (the
        reply is complete) the rest too."""
        out = MessageDelta()
        if self.reasoning is None:
            out.content = text
        else:
            split = self.reasoning.feed(text)
            out.reasoning, out.content = split.reasoning, split.content
            if final:
                split = self.reasoning.finish()
                out.reasoning += split.reasoning
                out.content += split.content
        if self.tools is not None:
            parsed = self.tools.feed(out.content)
            if final:
                parsed.extend(self.tools.finish())
            out.content = parsed.content
            out.tool_calls = [c for c in parsed.tool_calls if self.max_calls is None or c.index < self.max_calls]
            for call in out.tool_calls:
                self.arguments.setdefault(call.index, []).append(call.arguments)
        out.reasoning = self.reasoning_filter.feed(out.reasoning, final)
        out.content = self.content_filter.feed(out.content, final)
        return out

    def message(self, text: str) -> ChatMessage:
        """The message of a complete reply ``text`` (its content is None when it is only reasoning or tool
        calls)."""
        delta = self.feed(text, final=True)
        calls: dict[int, ToolCall] = {}
        for piece in delta.tool_calls:
            if piece.index not in calls:
                calls[piece.index] = ToolCall(id=piece.id, function=FunctionCall(name=piece.name, arguments=''))
            calls[piece.index].function.arguments += piece.arguments
        content = delta.content or (None if calls or delta.reasoning else '')
        return ChatMessage(content=content, reasoning_content=delta.reasoning or None,
                           tool_calls=[calls[i] for i in sorted(calls)] or None)

    def reasoning_tokens(self, detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> int | None:
        """How many of the reply's ``token_ids`` (all fed, as text, before) are reasoning (see
        :class:`ReasoningCounter`; ``detokenizer`` is fresh, set up as the engine's was); None without a
        reasoning parser."""
        if self.reasoning is None:
            return None
        counter = ReasoningCounter(detokenizer)
        counter.add(token_ids)
        return counter.count(self.reasoning)

    def delta_body(self, delta: MessageDelta) -> dict[str, Any]:
        """A stream chunk's ``delta``: the content, the reasoning when there is a reasoning parser, and the
        tool-call pieces (a call's first piece with its id, type and name, later ones arguments only)."""
        body: dict[str, Any] = {'role': None, 'content': delta.content if delta.content or not delta else None}
        if self.reasoning is not None:
            body['reasoning_content'] = delta.reasoning or None
        if delta.tool_calls:
            body['tool_calls'] = _call_pieces(delta.tool_calls)
        return body

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` for a reply that stopped after making calls, all complete (their arguments JSON
        objects, none that the reply ended inside); else the engine's reason (``stop`` for a call a stop string
        cut)."""
        if engine_reason != 'stop' or not self.num_calls:
            return engine_reason
        cut = self.tools.cut_call
        if cut is not None and cut < self.num_calls:
            return engine_reason
        complete = all(_is_object(''.join(pieces)) for pieces in self.arguments.values())
        return 'tool_calls' if complete else engine_reason


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _call_pieces(pieces: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """The OpenAI ``tool_calls`` delta entries of ``pieces``, the pieces of one call merged."""
    out: list[dict[str, Any]] = []
    for piece in pieces:
        if out and out[-1]['index'] == piece.index:
            out[-1]['function']['arguments'] += piece.arguments
            continue
        entry: dict[str, Any] = {'index': piece.index}
        if piece.id is not None:
            entry.update(id=piece.id, type='function', function={'name': piece.name, 'arguments': piece.arguments})
        else:
            entry['function'] = {'arguments': piece.arguments}
        out.append(entry)
    return out
