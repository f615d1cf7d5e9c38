"""Command R7B and Command A tool calls: a JSON list of call objects, each naming its function under
``tool_name``, between ``<|START_ACTION|>`` and ``<|END_ACTION|>``, after the tool plan::

    <|START_THINKING|>I will look it up.<|END_THINKING|><|START_ACTION|>[
        {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
    ]<|END_ACTION|>
"""
from __future__ import annotations

from lmdeploy.serve.openai.tool_parsers.base import register_tool_parser
from lmdeploy.serve.openai.tool_parsers.json_lists import JsonListToolParser

OPEN, CLOSE = '<|START_ACTION|>', '<|END_ACTION|>'


@register_tool_parser('cohere2', 'command_a', 'command_r7b')
class CohereToolParser(JsonListToolParser):
    """A list of ``tool_name`` calls in ``<|START_ACTION|>...<|END_ACTION|>``, in the content that the ``cohere2``
    reasoning parser gives (the plan in ``reasoning_content``, the response without its tags). The calls' ids are
    the server's own; their arguments stream where the name comes before them."""

    open_tags, close_tag = (OPEN,), CLOSE
    markers = (OPEN, CLOSE)
    name_key = 'tool_name'
    reasoning_parser = 'cohere2'
