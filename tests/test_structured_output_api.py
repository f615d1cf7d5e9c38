"""Structured output through the server with the ``openai`` client, on a tiny random model: whatever
the model would say, a finished answer parses and validates (``response_format`` ``json_schema`` and
``json_object``; vLLM's ``structured_outputs`` ``json``, ``regex``, ``choice``, ``grammar``), on chat and
completions, streamed or not, with n > 1; what xgrammar cannot compile is a 400 with its reason."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{'role': 'user', 'content': 'Hello world!'}]
WEATHER = {'type': 'object', 'additionalProperties': False, 'required': ['city', 'temp', 'sunny', 'note'],
           'properties': {'city': {'type': 'string', 'enum': ['Paris', 'Rome']},
                          'temp': {'type': 'integer', 'minimum': -20, 'maximum': 45},
                          'sunny': {'type': 'boolean'},
                          'note': {'type': 'string', 'maxLength': 6}}}
REGEX = r'[a-z]{2,6}@(example|test)\.com'
CHOICES = ['yes', 'no', 'maybe']
GRAMMAR = 'root ::= "(" num ("+" num)? ")"\nnum ::= [0-9] | [1-9] [0-9]'


class Weather(BaseModel):
    city: Literal['Paris', 'Rome']
    temp: int = Field(ge=-20, le=45)
    sunny: bool


@pytest.fixture(scope='module')
def client(api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{api_server.url}/v1', api_key='none', max_retries=0)


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {'type': 'json_schema', 'json_schema': {'name': 'weather', 'schema': schema, 'strict': strict}}


@pytest.mark.parametrize('strict', [True, False])
def test_json_schema_answers_validate(client, strict):
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, n=3, temperature=1.0, seed=7, max_tokens=300,
                                       response_format=json_schema_format(WEATHER, strict))
    assert len(r.choices) == 3 and len({c.message.content for c in r.choices}) > 1
    for choice in r.choices:
        assert choice.finish_reason == 'stop'
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_openai_helpers_parse_streamed_and_whole(client):
    whole = client.chat.completions.parse(model='tiny', messages=MESSAGES, response_format=Weather, temperature=0,
                                          max_tokens=300)
    assert isinstance(whole.choices[0].message.parsed, Weather)
    with client.chat.completions.stream(model='tiny', messages=MESSAGES, response_format=Weather, temperature=0,
                                        max_tokens=300) as stream:
        contents = [e for e in stream if e.type == 'content.delta']
        final = stream.get_final_completion()
    assert len(contents) > 1
    assert final.choices[0].message.content == whole.choices[0].message.content
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed


def test_json_object(client):
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, n=4, temperature=1.0, seed=1, max_tokens=300,
                                       response_format={'type': 'json_object'})
    finished = [c for c in r.choices if c.finish_reason == 'stop']
    assert finished and all(c.finish_reason == 'length' for c in r.choices if c not in finished)
    assert all(isinstance(json.loads(c.message.content), dict) for c in finished)


def test_cut_by_max_tokens_is_length(client):
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=3, temperature=0,
                                       response_format=json_schema_format(WEATHER))
    assert r.choices[0].finish_reason == 'length' and r.usage.completion_tokens == 3
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def conforms(kind: str, text: str) -> bool:
    if kind == 'json':
        jsonschema.validate(json.loads(text), WEATHER)
        return True
    if kind == 'regex':
        return re.fullmatch(REGEX, text) is not None
    if kind == 'choice':
        return text in CHOICES
    return re.fullmatch(r'\((\d|[1-9]\d)(\+(\d|[1-9]\d))?\)', text) is not None


STRUCTURED = {'json': WEATHER, 'regex': REGEX, 'choice': CHOICES, 'grammar': GRAMMAR}


@pytest.mark.parametrize('kind', sorted(STRUCTURED))
def test_vllm_structured_outputs(client, kind):
    body = {'structured_outputs': {kind: STRUCTURED[kind]}}
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, n=3, temperature=1.0, seed=3, max_tokens=300,
                                       extra_body=body)
    assert all(c.finish_reason == 'stop' and conforms(kind, c.message.content) for c in r.choices)
    stream = client.chat.completions.create(model='tiny', messages=MESSAGES, n=2, temperature=1.0, seed=3,
                                            max_tokens=300, extra_body=body, stream=True)
    texts = ['', '']
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ''
    assert texts == [c.message.content for c in r.choices[:2]]


def test_json_schema_as_text(client):
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=300, temperature=0,
                                       extra_body={'structured_outputs': {'json': json.dumps(WEATHER)}})
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


def test_completions(client):
    r = client.completions.create(model='tiny', prompt=['Hello', 'The quick'], n=2, max_tokens=300, temperature=1.0,
                                  seed=2, extra_body={'structured_outputs': {'choice': CHOICES}})
    assert len(r.choices) == 4 and all(c.text in CHOICES and c.finish_reason == 'stop' for c in r.choices)
    r = client.completions.create(model='tiny', prompt='Hello', max_tokens=300, temperature=0,
                                  extra_body={'response_format': json_schema_format(WEATHER)})
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)


BAD = [
    ({'structured_outputs': {'regex': '('}}, 'structured_outputs', 'The parenthesis is not closed'),
    ({'structured_outputs': {'grammar': 'root ::= foo'}}, 'structured_outputs', 'Rule "foo" is not defined'),
    ({'response_format': json_schema_format({'type': 'foo'})}, 'response_format', 'Unsupported type'),
    ({'response_format': {'type': 'json_schema'}}, 'response_format.json_schema', 'needs json_schema.schema'),
    ({'structured_outputs': {'json': '{'}}, 'structured_outputs.json', 'not valid JSON'),
    ({'structured_outputs': {'regex': 'a', 'choice': ['a']}}, 'structured_outputs', 'exactly one'),
    ({'structured_outputs': {'choice': []}}, 'structured_outputs', 'non-empty'),
    ({'structured_outputs': {'regex': 'a'}, 'response_format': {'type': 'json_object'}}, 'structured_outputs',
     'cannot be combined'),
]


@pytest.mark.parametrize('endpoint', ['chat/completions', 'completions'])
@pytest.mark.parametrize('stream', [False, True])
@pytest.mark.parametrize('fields, param, message', BAD)
def test_bad_formats_are_400(api_server, endpoint, stream, fields, param, message):
    prompt = {'messages': MESSAGES} if endpoint == 'chat/completions' else {'prompt': 'Hello'}
    r = httpx.post(f'{api_server.url}/v1/{endpoint}',
                   json={'model': 'tiny', 'max_tokens': 4, 'stream': stream, **prompt, **fields})
    assert r.status_code == 400, r.text
    error = r.json()['error']
    assert error['param'] == param and message in error['message']
    assert httpx.get(f'{api_server.url}/health').status_code == 200


def test_stop_words_do_not_cut_a_constrained_answer(client):
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=50, stop=['cd', '@'],
                                       extra_body={'structured_outputs': {'regex': 'abcdefg@x'}})
    assert r.choices[0].message.content == 'abcdefg@x' and r.choices[0].finish_reason == 'stop'
