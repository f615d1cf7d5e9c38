"""Tool-call and reasoning parsers on text: every chunking of a reply gives the same message."""
from __future__ import annotations

import json

import pytest
from parser_checks import split

from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from lmdeploy.serve.openai.tool_parsers import (TOOL_PARSERS, NamedToolParser, RequiredToolParser, get_tool_parser,
                                                register_tool_parser)

HERMES = get_tool_parser('hermes')
LLAMA3 = get_tool_parser('llama3_json')
THINK = get_reasoning_parser('qwen3')


def hermes(max_calls=None):
    return lambda: ChoiceParser(None, HERMES(), max_calls)


def test_hermes_calls_among_text():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "note": "a \\"}\\" <b>"}}\n</tool_call>\n'
            '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>\n')
    assert split(hermes(), text) == {'reasoning': '', 'content': 'Let me look.', 'calls': [
        ('get_weather', '{"city": "Paris", "note": "a \\"}\\" <b>"}'), ('now', '{}')]}
    assert split(hermes(max_calls=1), text)['calls'] == [('get_weather', '{"city": "Paris", "note": "a \\"}\\" <b>"}')]


@pytest.mark.parametrize('text, content', [
    ('plain answer, no calls\n', 'plain answer, no calls\n'),
    ('a < b and <tool_ is not a tag', 'a < b and <tool_ is not a tag'),
    ('<tool_call>not json</tool_call> then text', '<tool_call>not json</tool_call> then text'),
    ('<tool_call>{"no_name": 1}</tool_call>', '<tool_call>{"no_name": 1}</tool_call>'),
    ('ends inside a tag <tool_ca', 'ends inside a tag <tool_ca'),
])
def test_hermes_text_stays_text(text, content):
    assert split(hermes(), text) == {'reasoning': '', 'content': content, 'calls': []}


def test_hermes_truncated_and_string_arguments():
    assert split(hermes(), '<tool_call>{"name": "f", "arguments": {"x": [1, 2')['calls'] == [('f', '{"x": [1, 2')]
    assert split(hermes(), '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')['calls'] == [
        ('f', '{"x": 1}')]
    assert split(hermes(), '<tool_call>{"name": "f"}</tool_call> done')['calls'] == [('f', '{}')]
    assert split(hermes(), '<tool_call>{"name": "f"}</tool_call> done')['content'] == 'done'
    assert split(hermes(), '<tool_call>{"name": "f", "arguments": null}</tool_call>')['calls'] == [('f', '{}')]
    unclosed = '<tool_call>{"name": "f", "arguments": {}} <tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert split(hermes(), unclosed) == {'reasoning': '', 'content': '', 'calls': [('f', '{}'), ('g', '{}')]}


def test_llama3_json():
    make = lambda: ChoiceParser(None, LLAMA3())  # noqa: E731
    text = '<|python_tag|>{"name": "search", "parameters": {"q": "fox"}}; {"name": "now", "parameters": {}}'
    assert split(make, text)['calls'] == [('search', '{"q": "fox"}'), ('now', '{}')]
    assert split(make, ' {"name": "now", "parameters": {}}')['calls'] == [('now', '{}')]
    assert split(make, 'The answer is {"a": 1}') == {'reasoning': '', 'content': 'The answer is {"a": 1}',
                                                      'calls': []}
    assert split(make, '{"answer": 42}') == {'reasoning': '', 'content': '{"answer": 42}', 'calls': []}


def test_forced_parsers():
    required = lambda: ChoiceParser(None, RequiredToolParser())  # noqa: E731
    text = '[{"name": "a", "parameters": {"x": [1, {"y": "]}"}]}}, {"name": "b", "parameters": {}}]'
    assert split(required, text)['calls'] == [('a', '{"x": [1, {"y": "]}"}]}'), ('b', '{}')]
    named = lambda: ChoiceParser(None, NamedToolParser('f'))  # noqa: E731
    assert split(named, ' {"x": "}"}\n') == {'reasoning': '', 'content': '', 'calls': [('f', '{"x": "}"}')]}
    assert split(named, '{}')['calls'] == [('f', '{}')]


@pytest.mark.parametrize('prompt, text, reasoning, content', [
    ('<|im_start|>assistant\n', '<think>\nhmm, </thin k>\n</think>\n\nThe answer', '\nhmm, </thin k>\n', 'The answer'),
    ('<|im_start|>assistant\n', 'No thinking here', '', 'No thinking here'),
    ('<|im_start|>assistant\n', '<think>cut short', 'cut short', ''),
    ('<｜Assistant｜><think>\n', 'opened by the prompt</think>42', 'opened by the prompt', '42'),
    ('assistant\n<think>\n\n</think>\n\n', '<think>x</think>y', '', '<think>x</think>y'),
])
def test_think_reasoning(prompt, text, reasoning, content):
    make = lambda: ChoiceParser(THINK(prompt))  # noqa: E731
    assert split(make, text) == {'reasoning': reasoning, 'content': content, 'calls': []}


def test_reasoning_then_tool_call():
    make = lambda: ChoiceParser(THINK(''), HERMES())  # noqa: E731
    text = '<think>I should call it.</think>\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert split(make, text) == {'reasoning': 'I should call it.', 'content': '', 'calls': [('f', '{"a": 1}')]}
    message = make().message(text)
    assert message.content is None and json.loads(message.tool_calls[0].function.arguments) == {'a': 1}


def test_grammar_marker_follows_the_prompt():
    assert THINK('<|im_start|>assistant\n').grammar_after() == '</think>'
    assert THINK('<think>\n').grammar_after() == '</think>'
    assert THINK('<|im_start|>assistant\n<think>\n\n</think>\n\n').grammar_after() is None


def test_cli_flags_name_registered_parsers(monkeypatch, capsys):
    from lmdeploy.cli import main, serve
    seen = []
    monkeypatch.setattr(serve, 'run_api_server', seen.append)
    main.main(['serve', 'api_server', '--tool-call-parser', 'llama3_json', '--reasoning-parser', 'deepseek_r1'])
    assert (seen[0].tool_call_parser, seen[0].reasoning_parser) == ('llama3_json', 'deepseek_r1')
    with pytest.raises(SystemExit):
        main.main(['serve', 'api_server', '--tool-call-parser', 'nope'])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_registries():
    assert {'hermes', 'qwen', 'llama3_json'} <= set(TOOL_PARSERS) and {'qwen3', 'deepseek_r1'} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match='known: .*hermes'):
        get_tool_parser('nope')

    @register_tool_parser('test-upper')
    class Upper(HERMES):
        pass

    try:
        assert get_tool_parser('test-upper') is Upper
    finally:
        del TOOL_PARSERS['test-upper']
