"""The ``mistral`` and ``deepseek_v3`` tool parsers on text: every chunking of a reply gives the same
message (markers split across deltas included)."""
from __future__ import annotations

import pytest
from parser_checks import split

from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser

MISTRAL = get_tool_parser('mistral')
DEEPSEEK = get_tool_parser('deepseek_v3')
ARGS = '{"city": "Paris", "note": "a \\"}\\" [x]"}'


# As served with tokenizers that make the markers special tokens (left out of text that holds no call)
def mistral(max_calls=None):
    return lambda: ChoiceParser(None, MISTRAL((), MISTRAL.markers), max_calls)


def deepseek():
    return lambda: ChoiceParser(None, DEEPSEEK((), DEEPSEEK.markers))


@pytest.mark.parametrize('text', [
    f'Let me check. [TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}, {{"name": "now", "arguments": {{}}}}]',
    f'Let me check.\n[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]now[ARGS]{{}}',
    f'Let me check.[TOOL_CALLS] get_weather[CALL_ID]a1b2c3d4e[ARGS]{ARGS}[TOOL_CALLS]now [ARGS]{{}}',
])
def test_mistral_calls(text):
    assert split(mistral(), text) == {'reasoning': '', 'content': 'Let me check.',
                                      'calls': [('get_weather', ARGS), ('now', '{}')]}
    assert split(mistral(max_calls=1), text)['calls'] == [('get_weather', ARGS)]


@pytest.mark.parametrize('text, content, calls', [
    ('no calls, [brackets] and [TOOL_ are text', 'no calls, [brackets] and [TOOL_ are text', []),
    ('[TOOL_CALLS]no args marker', 'no args marker', []),
    ('[TOOL_CALLS][{"answer": 42}]', '[{"answer": 42}]', []),
    ('[TOOL_CALLS]f[ARGS]{"x": [1, 2', '', [('f', '{"x": [1, 2')]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}] Done.', ' Done.', [('f', '{}')]),
])
def test_mistral_edges(text, content, calls):
    assert split(mistral(), text) == {'reasoning': '', 'content': content, 'calls': calls}


V3_CALL = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>'
V31_CALL = '<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>'


@pytest.mark.parametrize('call', [V3_CALL, V31_CALL])
def test_deepseek_calls(call):
    multi_line = '{\n  "city": "Paris"\n}'
    text = ('I will look it up.\n\n<｜tool▁calls▁begin｜>' + call.format(name='get_weather', args=ARGS) + '\n'
            + call.format(name='now', args=multi_line) + '<｜tool▁calls▁end｜>')
    assert split(deepseek(), text) == {'reasoning': '', 'content': 'I will look it up.',
                                       'calls': [('get_weather', ARGS), ('now', multi_line)]}


@pytest.mark.parametrize('text, content, calls', [
    ('plain <｜tool▁ text', 'plain <｜tool▁ text', []),
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{"a": 1}<｜tool▁call▁end｜>', '',
     [('f', '{"a": 1}')]),
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": ', '', [('f', '{"a": ')]),
    ('<｜tool▁calls▁begin｜>oops', 'oops', []),
    ('<｜tool▁calls▁begin｜>' + V31_CALL.format(name='f', args='{}') + '<｜tool▁calls▁end｜> after', ' after',
     [('f', '{}')]),
])
def test_deepseek_edges(text, content, calls):
    assert split(deepseek(), text) == {'reasoning': '', 'content': content, 'calls': calls}
