"""Falcon-H1 tool calls: a JSON list of calls in one ``<tool_call>`` block (Hermes writes one object there)::

    some text<tool_call>
    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]
    </tool_call>
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_lists import JsonListToolParser

OPEN, CLOSE = '<tool_call>', '</tool_call>'


@register_tool_parser('falcon_h1')
class FalconH1ToolParser(JsonListToolParser):
    """A list of calls in ``<tool_call>...</tool_call>``."""

    open_tags, close_tag = (OPEN,), CLOSE
    markers = (OPEN, CLOSE)
