"""The parsers of the families that write a JSON list of calls between tags (Jamba, Hunyuan, Falcon-H1, Command
R7B / Command A) and Hunyuan's and Cohere's reasoning, on text: every chunking of a reply (markers cut anywhere)
gives the same message."""
from __future__ import annotations

import json

import pytest
from parser_checks import split

from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.reasoning_parsers import get_reasoning_parser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser
from lmdeploy.serve.reasoning import MODEL_PARSERS, pick_reasoning_parser

NESTED = '{"where": {"city": "Zürich 東京", "near": [1, {"x": null}]}, "note": "a \\"]}\\" <b>"}'
# (tool parser, reasoning parser, opening tag, closing tag, a call object for a name and arguments)
FAMILIES = {
    'jamba': (None, '<tool_calls>', '</tool_calls>', '{{"name": "{}", "arguments": {}}}'),
    'hunyuan_a13b': ('hunyuan_a13b', '<tool_calls>', '</tool_calls>', '{{"name": "{}", "arguments": {}}}'),
    'falcon_h1': (None, '<tool_call>\n', '\n</tool_call>', '{{"name": "{}", "arguments": {}}}'),
    'cohere2': ('cohere2', '<|START_ACTION|>', '<|END_ACTION|>',
                '{{"tool_call_id": "0", "tool_name": "{}", "parameters": {}}}'),
}


def parser(name: str, prompt: str = ''):
    reasoning = FAMILIES[name][0]
    return lambda: ChoiceParser(get_reasoning_parser(reasoning)(prompt) if reasoning else None,
                                get_tool_parser(name)())


def calls(name: str, *items: str) -> str:
    _, open_tag, close_tag, call = FAMILIES[name]
    return open_tag + '[' + ', '.join(call.format(n, a) for n, a in items) + ']' + close_tag


@pytest.mark.parametrize('name', FAMILIES)
def test_several_calls_with_nested_unicode_arguments(name):
    text = 'Let me look.\n' + calls(name, ('get_weather', NESTED), ('now', '{}'))
    got = split(parser(name), text)
    assert got['content'] == 'Let me look.'
    assert [(n, json.loads(a)) for n, a in got['calls']] == [
        ('get_weather', json.loads(NESTED)), ('now', {})]


@pytest.mark.parametrize('name', FAMILIES)
@pytest.mark.parametrize('body', ['not a list', '[1, 2]', '[{"no": "name"}]', '[]', '{"name": "f"'])
def test_malformed_calls_stay_content(name, body):
    _, open_tag, close_tag, _ = FAMILIES[name]
    text = f'Hi. {open_tag}{body}{close_tag}'
    assert split(parser(name), text) == {'reasoning': '', 'content': text, 'calls': []}


@pytest.mark.parametrize('name', FAMILIES)
def test_a_call_cut_short_keeps_the_arguments_that_arrived(name):
    """Cohere's too, whose name comes after the call's id."""
    text = calls(name, ('get_weather', '{"city": "Pa"}')).split('Pa')[0] + 'Pa'
    assert split(parser(name), text) == {'reasoning': '', 'content': '', 'calls': [('get_weather', '{"city": "Pa')]}


def test_falcon_h1r_writes_one_call_per_tag():
    """Falcon-H1R writes Hermes' blocks, one object each: read beside Falcon-H1's lists."""
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + NESTED + '}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call>' + calls('falcon_h1', ('later', '{}')))
    assert split(parser('falcon_h1'), text) == {'reasoning': '', 'content': 'Let me check.', 'calls': [
        ('get_weather', NESTED), ('now', '{}'), ('later', '{}')]}
    not_a_call = 'Hi <tool_call>{"no": "name"}</tool_call> there'
    assert split(parser('falcon_h1'), not_a_call)['content'] == not_a_call
    assert split(parser('jamba'), '<tool_calls>{"name": "f", "arguments": {}}</tool_calls>')['calls'] == []


def test_hunyuan_reasoning_and_answer():
    text = ('<think>\nThe user wants the weather.\n</think>\n<answer>\nChecking.\n'
            + calls('hunyuan_a13b', ('get_weather', '{"city": "Paris"}')) + '\n</answer>')
    assert split(parser('hunyuan_a13b'), text) == {
        'reasoning': '\nThe user wants the weather.\n', 'content': 'Checking.',
        'calls': [('get_weather', '{"city": "Paris"}')]}
    answer = '<think>\nhm\n</think>\n<answer>\nIt is sunny in Zürich.\n</answer>'
    assert split(parser('hunyuan_a13b'), answer) == {'reasoning': '\nhm\n', 'content': 'It is sunny in Zürich.',
                                                    'calls': []}
    closed = '<|startoftext|>Hi<|extra_0|><think>\n\n</think>\n'  # enable_thinking=False closes it in the prompt
    assert split(parser('hunyuan_a13b', closed), '<answer>\nHello\n</answer>')['content'] == 'Hello'


def test_cohere_plan_is_reasoning_and_response_tags_go():
    text = ('<|START_THINKING|>I will look up the weather.<|END_THINKING|>'
            + calls('cohere2', ('get_weather', '{"city": "Paris"}'), ('now', '{}')))
    assert split(parser('cohere2'), text) == {
        'reasoning': 'I will look up the weather.', 'content': '',
        'calls': [('get_weather', '{"city": "Paris"}'), ('now', '{}')]}
    assert split(parser('cohere2'), '<|START_RESPONSE|>It is sunny.<|END_RESPONSE|>') == {
        'reasoning': '', 'content': 'It is sunny.', 'calls': []}
    reasoning = '<|START_THINKING|>Easy.<|END_THINKING|><|START_TEXT|>Four.<|END_TEXT|>'  # Command A Reasoning
    assert split(parser('cohere2'), reasoning) == {'reasoning': 'Easy.', 'content': 'Four.', 'calls': []}


def test_picked_for_their_model_types_and_named_as_vllm_names_them():
    assert MODEL_PARSERS['hunyuan_v1_moe'] == MODEL_PARSERS['hunyuan_v1_dense'] == ('hunyuan_a13b', 'hunyuan_a13b')
    assert MODEL_PARSERS['jamba'] == ('jamba', None) and MODEL_PARSERS['cohere2'] == ('cohere2', 'cohere2')
    assert pick_reasoning_parser('auto', 'jamba') is None
    assert get_tool_parser('hunyuan') is get_tool_parser('hunyuan_a13b')
    assert get_reasoning_parser('hunyuan') is get_reasoning_parser('hunyuan_a13b')
    assert get_tool_parser('command_a') is get_tool_parser('cohere2')
    assert MODEL_PARSERS['falcon_h1'] == ('falcon_h1', None)  # Falcon-H1 and H1R share it
