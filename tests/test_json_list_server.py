"""The Jamba, Hunyuan, Falcon-H1 and Command R7B / Command A (cohere2) tool parsers through the server with the
``openai`` client: a tiny random model, made by a regex to write the family's list of calls after some text, gets
them back as OpenAI tool calls, streamed and not; Hunyuan's and Cohere's answer tags are left out by the reasoning
parser their tool parser brings along (Cohere's on text: tests/test_json_list_parsers.py); a list that holds no
call stays content (a 200, not a 5xx)."""
from __future__ import annotations

import json

import openai
import pytest
from server_helpers import serve_per_parser, tiny_engine
from tool_models import save_tool_model

WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'parameters': {
    'type': 'object', 'properties': {'where': {'type': 'object'}}}}}
NOW = {'type': 'function', 'function': {'name': 'now', 'parameters': {'type': 'object', 'properties': {}}}}
ASK = [{'role': 'user', 'content': 'Weather in Zürich?'}]
ARGUMENTS = {'where': {'city': 'Zürich 東京', 'near': [1, {'x': None}]}}
CALLS = [('get_weather', json.dumps(ARGUMENTS, ensure_ascii=False)), ('now', '{}')]
NAMED = ', '.join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in CALLS)
COHERE = ', '.join(f'{{"tool_call_id": "{i}", "tool_name": "{n}", "parameters": {a}}}'
                   for i, (n, a) in enumerate(CALLS))
# per parser: a reply holding text and the two calls, and one whose tags hold no call (its content as written)
REPLIES = {
    'jamba': (f'Checking.\n<tool_calls>[{NAMED}]</tool_calls>', 'Hi <tool_calls>[1, 2]</tool_calls>'),
    'hunyuan_a13b': (f'<answer>\nChecking.\n<tool_calls>[{NAMED}]</tool_calls>\n</answer>',
                     '<answer>\nHi <tool_calls>[1, 2]</tool_calls>\n</answer>'),
    'falcon_h1': (f'Checking.\n<tool_call>\n[{NAMED}]\n</tool_call>', 'Hi <tool_call>[1, 2]</tool_call>'),
    # (a reply that starts with ``<|START_`` would be taken for the plan's opener, which this tokenizer splits)
    'cohere2': (f'Checking.<|START_ACTION|>[\n    {COHERE}\n]<|END_ACTION|>',
                'Hi <|START_ACTION|>[1, 2]<|END_ACTION|>'),
}


def regex(text: str) -> str:
    """A regex matching ``text`` alone."""
    return ''.join('\\' + c if c in '.^$*+?()[]{}|\\' else c for c in text)


@pytest.fixture(scope='module')
def servers(tmp_path_factory):
    engine = tiny_engine(save_tool_model(str(tmp_path_factory.mktemp('json_list_model'))))
    yield from serve_per_parser(engine)


def request(server, reply: str) -> dict:
    """A request that makes the model write ``reply``: the grammar lets the reply open a ``<think>`` block (a
    reasoning parser's opener, a single token here), which the bias forbids."""
    think, = server.engine.tokenizer.encode('<think>', add_special_tokens=False)
    return dict(model='m', messages=ASK, tools=[WEATHER, NOW], temperature=0, max_tokens=400,
                logit_bias={str(think): -100}, extra_body={'structured_outputs': {'regex': regex(reply)}})


@pytest.mark.parametrize('parser', sorted(REPLIES))
def test_calls_streamed_and_not(servers, parser):
    client = openai.OpenAI(base_url=f'{servers(parser).url}/v1', api_key='none', max_retries=0)
    body = request(servers(parser), REPLIES[parser][0])
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == 'tool_calls' and whole.message.content == 'Checking.'
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ('get_weather', ARGUMENTS), ('now', {})]
    with client.chat.completions.stream(**body) as stream:
        deltas = [e for e in stream if e.type == 'tool_calls.function.arguments.delta' and e.index == 0]
        final = stream.get_final_completion().choices[0]
    assert len(deltas) > 3  # the arguments stream as written, before the list ends
    assert final.finish_reason == 'tool_calls' and final.message.content == 'Checking.'
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len({c.id for c in final.message.tool_calls}) == 2


@pytest.mark.parametrize('parser', sorted(REPLIES))
def test_a_list_without_a_call_stays_content(servers, parser):
    client = openai.OpenAI(base_url=f'{servers(parser).url}/v1', api_key='none', max_retries=0)
    choice = client.chat.completions.create(**request(servers(parser), REPLIES[parser][1])).choices[0]
    opening, closing = ('<answer>\n', '\n</answer>') if parser == 'hunyuan_a13b' else ('', '')
    expected = REPLIES[parser][1].removeprefix(opening).removesuffix(closing)
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (expected, None, 'stop')
