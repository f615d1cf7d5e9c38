"""Falcon-H1 tool calls: a JSON list of calls in one ``<tool_call>`` block, or (Falcon-H1R, as Hermes) one call
object per block::

    some text<tool_call>
    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]
    </tool_call>
    <tool_call>{"name": "get_time", "arguments": {}}</tool_call>
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_lists import JsonListToolParser

OPEN, CLOSE = '<tool_call>', '</tool_call>'


@register_tool_parser('falcon_h1')
class FalconH1ToolParser(JsonListToolParser):
    """A list of calls, or one call, in ``<tool_call>...</tool_call>``."""

    open_tags, close_tag = (OPEN,), CLOSE
    single_calls = True
    markers = (OPEN, CLOSE)
