"""Tool calling through the server with the ``openai`` client, on a tiny random model whose template
renders tools: forced calls (``required``, a named function) always parse and validate; the Hermes
parser reads parallel calls; streamed calls add up to the non-streamed ones; bad tools are a 400."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import serve, tiny_engine
from tool_models import save_tool_model

from lmdeploy.serve.openai.tool_choice import template_messages

WEATHER_PARAMS = {'type': 'object', 'additionalProperties': False, 'required': ['city', 'unit', 'days'],
                  'properties': {'city': {'type': 'string', 'enum': ['Paris', 'Rome', 'Tokyo']},
                                 'unit': {'type': 'string', 'enum': ['C', 'F']},
                                 'days': {'type': 'integer', 'minimum': 1, 'maximum': 7}}}
WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'description': 'Weather forecast', 'strict': True,
                                            'parameters': WEATHER_PARAMS}}
NOW = {'type': 'function', 'function': {'name': 'now', 'strict': True,
                                        'parameters': {'type': 'object', 'properties': {},
                                                       'additionalProperties': False}}}
TOOLS = [WEATHER, NOW]
PARAMS = {'get_weather': WEATHER_PARAMS, 'now': NOW['function']['parameters']}
ASK = [{'role': 'user', 'content': 'Weather in Paris?'}]
# Forces a random model to write two Hermes-style calls, so that the parser has something to read.
TWO_CALLS = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "C", '
             r'"days": [1-7]\}\}\n</tool_call>\n<tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>')


@pytest.fixture(scope='module')
def tool_server(tmp_path_factory):
    path = save_tool_model(str(tmp_path_factory.mktemp('tool_model')))
    yield from serve(tiny_engine(path), model_name='tiny-tools', tool_call_parser='hermes')


@pytest.fixture(scope='module')
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{tool_server.url}/v1', api_key='none', max_retries=0)


def assert_valid_call(call) -> None:
    assert call.type == 'function' and call.id.startswith('call_')
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_required_gives_valid_calls(client):
    r = client.chat.completions.create(model='tiny-tools', messages=ASK, tools=TOOLS, tool_choice='required',
                                       parallel_tool_calls=False, n=3, temperature=1.0, seed=5, max_tokens=500)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == 'tool_calls' and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0])


def stream_with_helper(client, **kwargs):
    """The final completion of the ``openai`` stream helper, and its argument-delta events."""
    with client.chat.completions.stream(model='tiny-tools', messages=ASK, tools=TOOLS, **kwargs) as stream:
        deltas = [e for e in stream if e.type == 'tool_calls.function.arguments.delta']
        return stream.get_final_completion(), deltas


@pytest.mark.parametrize('name', ['get_weather', 'now'])
def test_named_function_streams_as_it_answers(client, name):
    choice = {'type': 'function', 'function': {'name': name}}
    whole = client.chat.completions.create(model='tiny-tools', messages=ASK, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=500)
    call, = whole.choices[0].message.tool_calls
    assert call.function.name == name and whole.choices[0].finish_reason == 'tool_calls'
    assert_valid_call(call)
    if name == 'now':
        assert json.loads(call.function.arguments) == {}
    final, deltas = stream_with_helper(client, tool_choice=choice, temperature=0, max_tokens=500)
    streamed, = final.choices[0].message.tool_calls
    assert streamed.function.name == name and streamed.function.arguments == call.function.arguments
    assert streamed.function.parsed_arguments == json.loads(call.function.arguments)
    assert final.choices[0].finish_reason == 'tool_calls'
    assert ''.join(d.arguments_delta for d in deltas) == call.function.arguments
    assert len(deltas) > (1 if name == 'get_weather' else 0)


def test_stream_chunks_have_openai_shape(client):
    chunks = list(client.chat.completions.create(model='tiny-tools', messages=ASK, tools=TOOLS, tool_choice='required',
                                                 parallel_tool_calls=False, temperature=0, max_tokens=500,
                                                 stream=True))
    pieces = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and first.id.startswith('call_') and first.type == 'function'
    assert first.function.name in PARAMS
    assert rest and all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    arguments = ''.join(p.function.arguments for p in pieces)
    jsonschema.validate(json.loads(arguments), PARAMS[first.function.name])
    assert chunks[-1].choices[0].finish_reason == 'tool_calls'


@pytest.mark.parametrize('parallel', [True, False])
def test_hermes_parser_reads_parallel_calls(client, parallel):
    kwargs = dict(model='tiny-tools', messages=ASK, tools=TOOLS, temperature=0, max_tokens=500,
                  parallel_tool_calls=parallel, extra_body={'structured_outputs': {'regex': TWO_CALLS}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert [name for name, _ in calls] == ['get_weather', 'now'][:2 if parallel else 1]
    assert calls[0][1]['city'] in ('Paris', 'Rome') and message.content is None
    assert all(c.id.startswith('call_') for c in message.tool_calls)
    final, _ = stream_with_helper(client, **{k: v for k, v in kwargs.items() if k not in ('model', 'messages',
                                                                                          'tools')})
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert final.choices[0].finish_reason == 'tool_calls'


def test_multi_turn_tool_conversation(tool_server, client):
    """The assistant's calls and the tool's result render through the chat template."""
    messages = ASK + [
        {'role': 'assistant', 'content': None, 'tool_calls': [
            {'id': 'call_1', 'type': 'function',
             'function': {'name': 'get_weather', 'arguments': '{"city": "Paris", "unit": "C", "days": 1}'}}]},
        {'role': 'tool', 'tool_call_id': 'call_1', 'content': '{"temp": 21}'},
        {'role': 'user', 'content': 'Thanks!'}]
    engine = tool_server.engine
    text = engine.processor.render(template_messages(messages), tools=TOOLS)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C", "days": 1}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>') in text
    assert '"name": "now"' in text
    r = client.chat.completions.create(model='tiny-tools', messages=messages, tools=TOOLS, tool_choice='none',
                                       temperature=0, max_tokens=8, extra_body={'ignore_eos': True})
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.tool_calls is None
    native = httpx.post(f'{tool_server.url}/generate', json={'input_ids': ids, 'max_tokens': 8, 'ignore_eos': True})
    assert native.json()['text'] == r.choices[0].message.content


def test_a_reply_call_goes_back_into_the_conversation(tool_server, client):
    r = client.chat.completions.create(model='tiny-tools', messages=ASK, tools=TOOLS, tool_choice='required',
                                       parallel_tool_calls=False, temperature=0, max_tokens=500)
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [{'role': 'assistant', 'tool_calls': [call.model_dump()]},
                      {'role': 'tool', 'tool_call_id': call.id, 'content': 'sunny'}]
    text = tool_server.engine.processor.render(template_messages(messages), tools=TOOLS)
    arguments = json.dumps(json.loads(call.function.arguments))
    assert f'{{"name": "{call.function.name}", "arguments": {arguments}}}\n</tool_call>' in text
    again = client.chat.completions.create(model='tiny-tools', messages=messages, tools=TOOLS, tool_choice='none',
                                           max_tokens=4, extra_body={'ignore_eos': True})
    assert again.usage.prompt_tokens == len(tool_server.engine.tokenizer.encode(text, add_special_tokens=False))


BAD = [
    ({'tools': [{'type': 'function', 'function': {'parameters': {}}}]}, 'tools.0.function.name', 'Field required'),
    ({'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'objekt'}}}]},
     'tools.0.function.parameters', 'not a valid JSON schema'),
    ({'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': ['x']}}]},
     'tools.0.function.parameters', 'valid dictionary'),
    ({'tools': TOOLS, 'tool_choice': {'type': 'function', 'function': {'name': 'missing'}}},
     'tool_choice.function.name', "'missing', which is not in tools"),
    ({'tools': [NOW, NOW]}, 'tools.1.function.name', 'unique'),
    ({'tool_choice': 'required'}, 'tool_choice', 'requires tools'),
    ({'tools': TOOLS, 'tool_choice': 'required', 'structured_outputs': {'regex': 'a'}}, 'tool_choice',
     'cannot be combined'),
    ({'tools': TOOLS, 'tool_choice': 'required', 'response_format': {'type': 'json_schema', 'json_schema': {}}},
     'response_format.json_schema', 'needs json_schema.schema'),
    ({'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {'$schema': 5}}}]},
     'tools.0.function.parameters', 'not a valid JSON schema'),
    ({'messages': ASK + [{'role': 'assistant', 'tool_calls': [{'id': 'x'}]}]}, 'messages.1.tool_calls.0', 'must be'),
    ({'tools': TOOLS, 'tool_choice': 'maybe'}, 'tool_choice', "got 'maybe'"),
    ({'tools': TOOLS, 'tool_choice': {'type': 'function'}}, 'tool_choice', 'Field required'),
]


@pytest.mark.parametrize('stream', [False, True])
@pytest.mark.parametrize('fields, param, message', BAD)
def test_bad_tools_are_400(tool_server, fields, param, message, stream):
    r = httpx.post(f'{tool_server.url}/v1/chat/completions',
                   json={'model': 'tiny-tools', 'messages': ASK, 'max_tokens': 4, 'stream': stream, **fields})
    assert r.status_code == 400, r.text
    error = r.json()['error']
    assert error['param'] == param and error['type'] == 'invalid_request_error'
    assert message in error['message']


@pytest.mark.parametrize('response_format', [{'type': 'json_object'}, {'type': 'json_schema', 'json_schema': {
    'name': 'answer', 'schema': {'type': 'object', 'properties': {'answer': {'type': 'string'}}}}}])
@pytest.mark.parametrize('tool_choice', ['required', {'type': 'function', 'function': {'name': 'get_weather'}}])
def test_a_forced_call_with_a_response_format_is_the_call(client, tool_choice, response_format):
    """Was a 400. As vLLM does, the forced call's grammar decides the reply: the response format is for the
    message's content, which a forced call leaves empty."""
    r = client.chat.completions.create(model='tiny-tools', messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                       response_format=response_format, parallel_tool_calls=False, temperature=0,
                                       max_tokens=500)
    choice = r.choices[0]
    assert choice.finish_reason == 'tool_calls' and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert_valid_call(call)
    assert tool_choice == 'required' or call.function.name == 'get_weather'


def test_auto_needs_a_parser(api_server):
    r = httpx.post(f'{api_server.url}/v1/chat/completions',
                   json={'model': 'tiny', 'messages': ASK, 'tools': TOOLS, 'max_tokens': 4})
    assert r.status_code == 400 and '--tool-call-parser' in r.json()['error']['message']
    forced = httpx.post(f'{api_server.url}/v1/chat/completions',
                        json={'model': 'tiny', 'messages': ASK, 'tools': TOOLS, 'tool_choice': 'required',
                              'max_tokens': 500, 'parallel_tool_calls': False, 'temperature': 0}, timeout=120)
    assert forced.status_code == 200 and forced.json()['choices'][0]['message']['tool_calls']
