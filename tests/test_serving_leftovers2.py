"""Follow-ups of the serving leftovers (docs/reliability.md, "Serving leftovers (2026-12-07)"): every tool parser
shows a marker that starts no call the same way, streamed and not."""
from __future__ import annotations

import pytest

from lmdeploy.serve.openai.tool_parsers import TOOL_PARSERS, ParsedDelta
from lmdeploy.serve.openai.tool_parsers.harmony import HarmonyToolParser

# parser, its marker that starts calls, whether the family's own tokenizers make it a special token, where it
# starts calls ('anywhere', or only at the reply's start)
MARKERS = [
    ('mistral', '[TOOL_CALLS]', True, 'anywhere'),
    ('deepseek_v3', '<｜tool▁calls▁begin｜>', True, 'anywhere'),
    ('granite', '<|tool_call|>', True, 'anywhere'),  # Granite 3.0
    ('granite', '<tool_call>', False, 'anywhere'),  # Granite 3.1 on
    ('hermes', '<tool_call>', False, 'anywhere'),  # Qwen2.5, Qwen3
    ('qwen3_coder', '<tool_call>', False, 'anywhere'),
    ('glm45', '<tool_call>', True, 'anywhere'),
    ('seed_oss', '<seed:tool_call>', True, 'anywhere'),
    ('pythonic', '<|python_start|>', True, 'anywhere'),  # Llama 4
    ('llama3_json', '<|python_tag|>', True, 'start'),
]
# what follows the marker: nothing, text, whitespace, a list that holds no call
AFTER = ['', 'not a call', ' ', '[1, 2] x']


def pieces(parser, text: str) -> ParsedDelta:
    """The reply fed one character at a time, as a stream may cut it."""
    out = ParsedDelta()
    for char in text:
        out.extend(parser.feed(char))
    return out.extend(parser.finish())


def test_every_parser_but_harmony_is_covered():
    """Harmony's markers frame messages (a header, then a body), not calls among text: it is left out."""
    covered = {TOOL_PARSERS.lookup(name) for name, *_ in MARKERS}
    assert covered | {HarmonyToolParser} == set(TOOL_PARSERS.values())


@pytest.mark.parametrize('after', AFTER, ids=['at the end', 'text', 'whitespace', 'a list'])
@pytest.mark.parametrize('name, marker, special, where', MARKERS, ids=[f'{m[0]} {m[1]}' for m in MARKERS])
def test_a_marker_that_starts_no_call_leaves_the_text_as_written_less_a_special_marker(name, marker, special,
                                                                                       where, after):
    """Was: ``Hi. `` (mistral, deepseek_v3), ``Hi.`` (hermes), ``Hi. <|tool_call|>`` (granite) for a marker at the
    reply's end; glm45, seed_oss and pythonic kept their special markers. Now every parser gives the text as
    written, the whitespace before the marker included, less the marker where it is a special token (as the
    reply shows without a parser, the detokenizer skipping special tokens), streamed and not."""
    before = 'Hi. ' if where == 'anywhere' else ''
    text = before + marker + after
    expected = before + ('' if special else marker) + after
    parser = TOOL_PARSERS.lookup(name)
    assert parser().parse(text) == ParsedDelta(expected)
    assert pieces(parser(), text) == ParsedDelta(expected)
