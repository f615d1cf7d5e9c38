"""The ``glm45`` tool and reasoning parsers on text: every chunking of a GLM-4.5 reply gives the same message
(tags split across deltas included); JSON values decoded, other values kept as strings."""
from __future__ import annotations

import json

import pytest
from parser_checks import split

from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.reasoning_parsers import get_reasoning_parser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser

GLM45 = get_tool_parser('glm45')
WEATHER = json.dumps({'city': 'Paris', 'days': 3, 'units': ['c', 'f'], 'note': 'a <b> "c"'}, ensure_ascii=False)
# GLM-4.5's template: newlines between the tags; GLM-4.6's: none
CALL_45 = ('<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n'
           '<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n<arg_value>["c", "f"]</arg_value>\n'
           '<arg_key>note</arg_key>\n<arg_value>a <b> "c"</arg_value>\n</tool_call>')
CALL_46 = ('<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>'
           '<arg_value>3</arg_value><arg_key>units</arg_key><arg_value>["c", "f"]</arg_value><arg_key>note</arg_key>'
           '<arg_value>a <b> "c"</arg_value></tool_call>')


def glm45(prompt: str | None = None, max_calls: int | None = None):
    reasoning = get_reasoning_parser('glm45')
    return lambda: ChoiceParser(None if prompt is None else reasoning(prompt), GLM45(), max_calls)


@pytest.mark.parametrize('call', [CALL_45, CALL_46])
def test_calls(call):
    text = f'Let me check.\n{call}\n<tool_call>now\n</tool_call>'
    expected = {'reasoning': '', 'content': 'Let me check.', 'calls': [('get_weather', WEATHER), ('now', '{}')]}
    assert split(glm45(), text) == expected
    assert split(glm45(max_calls=1), text)['calls'] == [('get_weather', WEATHER)]


def test_reasoning_then_call():
    """The reply reasons in ``<think>`` first; with thinking off the template closes an empty block in the
    prompt and the reply is all content."""
    text = f'<think>The user wants the weather.</think>\nChecking.{CALL_46}'
    assert split(glm45('<|user|>\nweather?<|assistant|>'), text) == {
        'reasoning': 'The user wants the weather.', 'content': 'Checking.', 'calls': [('get_weather', WEATHER)]}
    closed = '<|user|>\nweather?<|assistant|>\n<think></think>\n'
    assert split(glm45(closed), f'Checking.{CALL_46}') == {
        'reasoning': '', 'content': 'Checking.', 'calls': [('get_weather', WEATHER)]}
    assert get_reasoning_parser('glm45').markers == ('<think>', '</think>')


@pytest.mark.parametrize('text, content, calls', [
    ('no calls, <tool_ and <arg_key> are text', 'no calls, <tool_ and <arg_key> are text', []),
    ('<tool_call>two words</tool_call>', '<tool_call>two words</tool_call>', []),
    ('<tool_call>f<arg_key>x</arg_key>y</tool_call> after', '<tool_call>f<arg_key>x</arg_key>y</tool_call> after', []),
    ('<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value>', '', [('f', '{"x": 1}')]),
    ('<tool_call>f<arg_key>flag</arg_key><arg_value>true</arg_value></tool_call> Done.', 'Done.',
     [('f', '{"flag": true}')]),
])
def test_edges(text, content, calls):
    """Text that only looks like tags, blocks that hold no call (back into the text as they were: GLM-4.5's
    tokenizer does not make its tags special tokens), a call the reply left open, and text after a call."""
    assert split(glm45(), text) == {'reasoning': '', 'content': content, 'calls': calls}


def test_values_typed_by_the_schema():
    """A string parameter's value stays its text (``3`` included), however it reads; others are JSON."""
    tools = [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object', 'properties': {
        'code': {'type': 'string'}, 'n': {'type': 'integer'}}}}}]
    text = '<tool_call>f<arg_key>code</arg_key><arg_value>3</arg_value><arg_key>n</arg_key><arg_value>3</arg_value>' \
           '<arg_key>x</arg_key><arg_value>NaN</arg_value></tool_call>'
    calls = split(lambda: ChoiceParser(None, GLM45(tools)), text)['calls']
    assert calls == [('f', '{"code": "3", "n": 3, "x": "NaN"}')]  # NaN is no JSON value
