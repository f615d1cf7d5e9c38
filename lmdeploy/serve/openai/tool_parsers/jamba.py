"""Jamba 1.5 to 1.7 tool calls: a JSON list of calls in ``<tool_calls>``::

    some text<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_lists import JsonListToolParser

OPEN, CLOSE = '<tool_calls>', '</tool_calls>'


@register_tool_parser('jamba')
class JambaToolParser(JsonListToolParser):
    """A list of calls in ``<tool_calls>...</tool_calls>``."""

    open_tags, close_tag = (OPEN,), CLOSE
    markers = (OPEN, CLOSE)


@register_tool_parser('hunyuan_a13b', 'hunyuan')
class HunyuanToolParser(JambaToolParser):
    """Hunyuan-A13B's and Hunyuan dense's calls, in the same tags as Jamba's, in the answer that the
    ``hunyuan_a13b`` reasoning parser gives (the reply's ``<answer>`` block, without its tags)."""

    reasoning_parser = 'hunyuan_a13b'
