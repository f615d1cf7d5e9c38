"""MiniMax-M2 tool calls: ``<invoke>`` elements in ``<minimax:tool_call>`` blocks, each value between its
parameter's tags (strings as written, other values in JSON)::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Read as Qwen3-Coder's calls are (``xml_calls.py``); MiniMax-M2 reasons in ``<think>`` blocks first (the ``qwen3``
reasoning parser).
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import register_tool_parser
from lmdeploy.serve.openai.tool_parsers.xml_calls import XmlCallsParser


@register_tool_parser('minimax_m2')
class MiniMaxM2ToolParser(XmlCallsParser):
    """``<minimax:tool_call><invoke name="NAME"><parameter name="ARG">VALUE</parameter>...</invoke>
    </minimax:tool_call>``."""

    open_tag, close_tag = '<minimax:tool_call>', '</minimax:tool_call>'
    markers = (open_tag, close_tag)
    function_tag, function_end = '<invoke name=', '</invoke>'
    parameter_tag = '<parameter name='
    quoted_names = True
