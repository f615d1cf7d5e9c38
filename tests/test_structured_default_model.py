"""Structured output and forced tool calls on the bundled default model, through the server and the
``openai`` client: the constrained answers are valid and make sense."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import serve

from lmdeploy import PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine

pytestmark = pytest.mark.slow

CAPITAL = {'type': 'object', 'additionalProperties': False, 'required': ['capital'],
           'properties': {'capital': {'type': 'string', 'maxLength': 30}}}
WEATHER = {'type': 'object', 'additionalProperties': False, 'required': ['city', 'unit'],
           'properties': {'city': {'type': 'string', 'maxLength': 30},
                          'unit': {'type': 'string', 'enum': ['celsius', 'fahrenheit']}}}
TOOLS = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'Get the current weather in a city',
                                           'parameters': WEATHER, 'strict': True}}]


@pytest.fixture(scope='module')
def server():
    engine = AsyncEngine(None, PytorchEngineConfig(max_batch_size=8, num_gpu_blocks=64), show_progress=False)
    yield from serve(engine, model_name='smol')


@pytest.fixture(scope='module')
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{server.url}/v1', api_key='none', max_retries=0)


def test_json_schema_answer(client):
    question = 'What is the capital of France? Answer in JSON with the key "capital".'
    r = client.chat.completions.create(model='smol', messages=[{'role': 'user', 'content': question}], temperature=0,
                                       max_tokens=60, response_format={'type': 'json_schema', 'json_schema': {
                                           'name': 'capital', 'schema': CAPITAL, 'strict': True}})
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, CAPITAL)
    assert r.choices[0].finish_reason == 'stop' and 'Paris' in answer['capital']


def test_forced_tool_call_streams_like_the_whole(client):
    kwargs = dict(model='smol', messages=[{'role': 'user', 'content': 'What is the weather like in Paris today?'}],
                  tools=TOOLS, tool_choice='required', parallel_tool_calls=False, temperature=0, max_tokens=80)
    call, = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert call.function.name == 'get_weather' and 'Paris' in arguments['city']
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    streamed, = final.choices[0].message.tool_calls
    assert streamed.function.arguments == call.function.arguments and streamed.function.parsed_arguments == arguments
    assert final.choices[0].finish_reason == 'tool_calls'
