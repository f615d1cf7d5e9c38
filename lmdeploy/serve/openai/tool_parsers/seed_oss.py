"""Seed-OSS tool calls: Qwen3-Coder's XML-style calls in ``<seed:tool_call>`` blocks, each value right
between its tags::

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    <parameter=days>3</parameter>
    </function>
    </seed:tool_call>

Seed-OSS reasons in ``<seed:think>`` blocks first (the ``seed_oss`` reasoning parser).
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import register_tool_parser
from lmdeploy.serve.openai.tool_parsers.xml_calls import XmlCallsParser


@register_tool_parser('seed_oss')
class SeedOssToolParser(XmlCallsParser):
    """``<seed:tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></seed:tool_call>``."""

    open_tag, close_tag = '<seed:tool_call>', '</seed:tool_call>'
    markers = (open_tag, close_tag)
