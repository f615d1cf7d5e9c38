"""Qwen3-Coder, Qwen3-Coder-Next and Qwen3.5 tool calls: XML-style tags in ``<tool_call>`` blocks, each value
on its own lines (strings as written, other values in JSON)::

    I'll look it up.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

See ``xml_calls.py`` for how the block is read and ``arguments.py`` for how the values are typed.
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import register_tool_parser
from lmdeploy.serve.openai.tool_parsers.xml_calls import XmlCallsParser


@register_tool_parser('qwen3_coder', 'qwen3_xml')
class Qwen3CoderToolParser(XmlCallsParser):
    """``<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>``."""

    open_tag, close_tag = '<tool_call>', '</tool_call>'
    markers = (open_tag, close_tag)
