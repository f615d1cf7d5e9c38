"""Helpers for the parsers that read a reply as it grows (tool calls, reasoning)."""
from __future__ import annotations

import re
from collections.abc import Collection

WHITESPACE = ' \t\r\n'


def held_back(text: str, start: int, tag: str) -> int:
    """Where ``text[start:]`` can be given out up to while more may follow: before a tail that could
    be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - size:]):
            return len(text) - size
    return len(text)


def skip_whitespace(text: str, pos: int) -> int:
    """The first index from ``pos`` that is not whitespace (``len(text)`` if none)."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def strip_end(text: str, start: int, end: int) -> int:
    """``end`` moved back over the whitespace before it, not past ``start``."""
    while end > start and text[end - 1] in WHITESPACE:
        end -= 1
    return end


class MarkerFilter:
    """Drops ``markers`` from text given piecewise, holding back a tail that may start one until more text
    (or ``final``) settles it, so that every chunking gives the same text."""

    def __init__(self, markers: Collection[str]) -> None:
        self.markers = sorted(markers, key=len, reverse=True)
        self.pattern = re.compile('|'.join(map(re.escape, self.markers))) if self.markers else None
        self.held = ''

    def feed(self, text: str, final: bool) -> str:
        """What of ``self.held + text`` can be given out, the markers left out."""
        if self.pattern is None:
            return text
        text = self.pattern.sub('', self.held + text)
        end = len(text) if final else min(held_back(text, 0, marker) for marker in self.markers)
        self.held = text[end:]
        return text[:end]
