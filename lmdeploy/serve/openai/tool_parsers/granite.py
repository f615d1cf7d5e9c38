"""Granite 3 tool calls: ``<|tool_call|>`` (a special token of Granite 3.0; Granite 3.1 on write the text
``<tool_call>``) and a JSON list of calls, with no closing tag::

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_lists import JsonListToolParser

MARKERS = ('<|tool_call|>', '<tool_call>')


@register_tool_parser('granite')
class GraniteToolParser(JsonListToolParser):
    """A list of calls after ``<|tool_call|>`` or ``<tool_call>``."""

    markers = open_tags = MARKERS
