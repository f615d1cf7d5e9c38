"""What every reasoning parser is: a stateful splitter of one choice's reply into reasoning and content.

A parser is made for a request's rendered prompt (a template may open, or close, the reasoning block
there), fed the reply as it is generated (:meth:`ReasoningParser.feed`) and flushed at the end
(:meth:`ReasoningParser.finish`). The pieces of any chunking of the same reply add up to the same split.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from lmdeploy.serve.openai.registry import Registry


@dataclass
class ReasoningDelta:
    """New reasoning text and new content text."""

    reasoning: str = ''
    content: str = ''


class ReasoningParser(ABC):
    """Splits one choice's reply into reasoning and content, fed piecewise.

    ``end_marker`` is the text after which the reply's content starts: a grammar for the content applies
    from there (see :meth:`grammar_after`). ``markers`` are the tags the parser reads: the detokenizer keeps
    those that the served tokenizer makes special tokens in the reply's text. ``history_field`` is the
    assistant message's field in which the chat templates of the parser's models take the reasoning back.
    """

    end_marker: str
    markers: tuple[str, ...] = ()
    history_field: str = 'reasoning_content'

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt
        self.text = ''
        self.pos = 0
        # Where the reasoning given out so far stands in ``text``: ``[start, end)`` pieces, in order.
        self.reasoning_spans: list[tuple[int, int]] = []

    @abstractmethod
    def reasoning_enabled(self) -> bool:
        """Whether the reply may reason at all (False when the prompt already closed the reasoning)."""

    def grammar_after(self) -> str | None:
        """The marker after which a grammar for the content applies (None: from the reply's start)."""
        return self.end_marker if self.reasoning_enabled() else None

    def grammar_opener(self) -> str | None:
        """The marker that opens the reasoning when the reply may or may not open it (None: the reply is
        reasoning from its start): without it, a grammar for the content applies from the reply's start."""
        return None

    def feed(self, text: str) -> ReasoningDelta:
        """The split that ``text``, appended to the reply, makes certain."""
        self.text += text
        return self._advance(False)

    def finish(self) -> ReasoningDelta:
        """The rest, once the reply is complete."""
        return self._advance(True)

    def _reason(self, out: ReasoningDelta, start: int, end: int) -> None:
        """Gives out ``text[start:end]`` as reasoning and records where it stands."""
        if end <= start:
            return
        out.reasoning += self.text[start:end]
        if self.reasoning_spans and self.reasoning_spans[-1][1] == start:
            start = self.reasoning_spans.pop()[0]
        self.reasoning_spans.append((start, end))

    @abstractmethod
    def _advance(self, final: bool) -> ReasoningDelta:
        """Consumes ``self.text`` from ``self.pos`` as far as it is certain (all of it when ``final``)."""


REASONING_PARSERS: Registry[ReasoningParser] = Registry('reasoning parser')
register_reasoning_parser = REASONING_PARSERS.register
get_reasoning_parser = REASONING_PARSERS.lookup
