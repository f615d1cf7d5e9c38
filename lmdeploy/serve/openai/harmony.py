"""Reading OpenAI's harmony format (gpt-oss) from a reply as it grows.

A reply is a run of messages, each ``<|start|>HEADER<|message|>BODY`` ended by ``<|end|>``, or by
``<|call|>`` (a tool call) or ``<|return|>`` (the answer), which end the reply too::

    <|channel|>analysis<|message|>Thinking.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The header names the role, the ``<|channel|>`` (``analysis``, ``commentary``, ``final``), and the
recipient (``to=functions.NAME``, before or after the channel). The prompt opens the first message
(``<|start|>assistant``), so the reply starts inside its header. The markers are special tokens: the
detokenizer keeps them only when asked (``GenerationConfig.keep_special_tokens``, see
:data:`SPECIAL_TOKENS`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from lmdeploy.serve.openai.text_scan import held_back

START, MESSAGE, CHANNEL, CONSTRAIN = '<|start|>', '<|message|>', '<|channel|>', '<|constrain|>'
END, CALL, RETURN = '<|end|>', '<|call|>', '<|return|>'
SPECIAL_TOKENS = (START, MESSAGE, CHANNEL, CONSTRAIN, END, CALL, RETURN)
# What ends a message's body: a terminator, or (from a model that left it out) the next message's start.
_BODY_ENDS = (END, CALL, RETURN, START)
_CHANNEL = re.compile(re.escape(CHANNEL) + r'\s*([^\s<]+)')
_RECIPIENT = re.compile(r'\bto=([^\s<]+)')
FUNCTIONS = 'functions.'


@dataclass
class Header:
    """A message's header: its text as written (after ``<|start|>``), its channel and its recipient."""

    text: str
    channel: str | None = None
    recipient: str | None = None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
        return cls(text, channel and channel.group(1), recipient and recipient.group(1))

    @property
    def function(self) -> str | None:
        """The name of the function the message calls (None: it calls none)."""
        if self.recipient and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):]
        return None


def open_header(prompt: str) -> str | None:
    """The header text a prompt began (``'assistant'`` after ``<|start|>assistant``); None when the prompt
    ends outside a header."""
    start = prompt.rfind(START)
    if start < 0 or MESSAGE in prompt[start:]:
        return None
    return prompt[start + len(START):]


def _first(text: str, pos: int, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(i, m) for m in markers if (i := text.find(m, pos)) >= 0]
    return min(found) if found else None


class HarmonyReader:
    """Splits a growing reply into events, each ``(kind, value)``: ``('text', str)`` outside messages,
    ``('header', Header)`` once a header is complete, ``('body', str)`` pieces of the message's body and
    ``('end', marker)`` when it ends (``''`` when the reply ends first).

    ``header`` is the header text the prompt began (see :func:`open_header`); None: the reply starts
    outside a message. Nothing after ``<|call|>`` or ``<|return|>`` is read.
    """

    def __init__(self, header: str | None = None):
        self.state = 'outside' if header is None else 'header'
        self.prefix = header or ''
        self.pos = 0
        self.body_spans: list[tuple[int, int]] = []  # where each ('body', ...) event's text stands in the reply

    def advance(self, text: str, final: bool) -> list[tuple[str, str | Header]]:
        """The events that ``text`` (the reply so far) makes certain; with ``final`` all of them."""
        out: list[tuple[str, str | Header]] = []
        while self.state != 'done':
            if self.state == 'outside':
                found = text.find(START, self.pos)
                end = found if found >= 0 else len(text) if final else held_back(text, self.pos, START)
                if end > self.pos:
                    out.append(('text', text[self.pos:end]))
                self.pos = end
                if found < 0:
                    break
                self.pos, self.state, self.prefix = found + len(START), 'header', ''
            elif self.state == 'header':
                found = _first(text, self.pos, (MESSAGE, START))
                if found is None:
                    if final:
                        self.state = 'done'
                    break
                at, marker = found
                if marker == START:  # a header without a body: the next message starts over
                    self.pos, self.prefix = at + len(START), ''
                    continue
                out.append(('header', Header.parse(self.prefix + text[self.pos:at])))
                self.pos, self.state = at + len(MESSAGE), 'body'
            else:
                found = _first(text, self.pos, _BODY_ENDS)
                if found is None:
                    end = len(text) if final else min(held_back(text, self.pos, m) for m in _BODY_ENDS)
                    if end > self.pos:
                        out.append(('body', text[self.pos:end]))
                        self.body_spans.append((self.pos, end))
                    self.pos = end
                    if final:
                        out.append(('end', ''))
                        self.state = 'done'
                    break
                at, marker = found
                if at > self.pos:
                    out.append(('body', text[self.pos:at]))
                    self.body_spans.append((self.pos, at))
                out.append(('end', '' if marker == START else marker))
                if marker == START:
                    self.pos, self.state = at, 'outside'
                else:
                    self.pos, self.state = at + len(marker), 'done' if marker in (CALL, RETURN) else 'outside'
        return out
