"""Hostile input through a real uvicorn server: each attack that once gave a 5xx (or failed other requests)
is a 400 now, and afterwards the server answers a normal request with every KV block free."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_helpers import serve, slow_down, tiny_engine

from lmdeploy.serve.openai.limits import RequestLimits

CHAT = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4}


@pytest.fixture(scope='module')
def server(tiny_llama):
    engine = tiny_engine(tiny_llama, session_len=256)
    slow_down(engine, 0.01)
    # no size limit: a big enum reaches the compile, and its time limit (test_grammar_cost.py tests the size's)
    yield from serve(engine, model_name='tiny',
                     limits=RequestLimits(max_grammar_compile_seconds=1, max_grammar_size=None))


@pytest.fixture
def url(server):
    """The server's address; after the test the server is idle: a normal request is answered and no KV block
    is held."""
    yield server.url
    assert httpx.post(f'{server.url}/v1/chat/completions', json=CHAT, timeout=60).status_code == 200
    blocks = server.engine.engine.block_manager
    deadline = time.monotonic() + 10
    while blocks.num_free_blocks != blocks.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert blocks.num_free_blocks == blocks.num_blocks
    m = server.metrics()
    assert m['lmdeploy:num_requests_running'] == m['lmdeploy:num_requests_waiting'] == 0


def _error(response: httpx.Response, param: str | None = None) -> str:
    assert response.status_code == 400, response.text
    error = response.json()['error']
    assert error['type'] == 'invalid_request_error' and error['param'] == param, error
    return error['message']


def _raw(url: str, path: str, body: str) -> httpx.Response:
    return httpx.post(f'{url}{path}', content=body.encode(), headers={'content-type': 'application/json'}, timeout=60)


@pytest.mark.parametrize('path, body, param', [
    ('/v1/chat/completions', '{"model":"tiny","messages":[{"role":"user","content":"hi \\ud800"}]}', 'messages'),
    ('/v1/chat/completions', '{"model":"tiny","messages":[{"role":"\\udfff","content":"hi"}]}', 'messages'),
    ('/v1/chat/completions', '{"model":"tiny","stream":true,"messages":[{"role":"user","content":"\\ud800"}]}',
     'messages'),
    ('/v1/chat/completions', '{"model":"tiny","messages":[{"role":"user","content":"hi","\\ud800":1}]}', 'messages'),
    ('/v1/completions', '{"model":"tiny","prompt":"a\\ud800"}', 'prompt'),
    ('/v1/completions', '{"model":"tiny","prompt":"a","stop":["\\udc00"]}', 'stop'),
    ('/generate', '{"prompt":"a\\ud800"}', 'prompt'),
    ('/v1/encode', '{"input":["ok","\\ud800"]}', 'input'),
])
def test_lone_surrogates_are_400(url, path, body, param):
    """JSON may escape a lone UTF-16 surrogate, which no text holds: it reached the tokenizer (a TypeError, a 500
    and a reset connection) before."""
    assert 'lone UTF-16 surrogate' in _error(_raw(url, path, body), param)


def test_surrogate_pairs_are_text(url):
    body = '{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"hi \\ud83d\\ude00"}]}'
    assert _raw(url, '/v1/chat/completions', body).status_code == 200


def _nested(depth: int) -> str:
    return '[' * depth + ']' * depth


def _deep_schema(levels: int) -> dict:
    schema = {'type': 'string'}
    for _ in range(levels):
        schema = {'type': 'object', 'properties': {'a': schema}, 'required': ['a']}
    return schema


def test_deep_json_is_400(url):
    """Deep nesting ran the chat template's and jsonschema's recursion out of stack (500s) before."""
    body = '{"model":"tiny","messages":[{"role":"user","content":"hi","x":%s}]}'
    assert 'deeper than 64 levels' in _error(_raw(url, '/v1/chat/completions', body % _nested(900)), 'messages')
    tools = [{'type': 'function', 'function': {'name': 'f', 'parameters': _deep_schema(200)}}]
    response = httpx.post(f'{url}/v1/chat/completions', json={**CHAT, 'tools': tools, 'tool_choice': 'none'})
    assert 'deeper than 64 levels' in _error(response, 'tools')
    ok = '{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"hi","x":%s}]}' % _nested(60)
    assert _raw(url, '/v1/chat/completions', ok).status_code == 200


@pytest.mark.parametrize('arguments, says', [
    ('[' * 1100 + ']' * 1100, 'deeper than 64 levels'),       # more than json.loads reads: a 500 before
    ('{"a":' * 65 + '1' + '}' * 65, 'deeper than 64 levels'),  # what a body may not nest either
    ('{"a": "\\ud800"}', 'lone UTF-16 surrogate'),           # an escape only the arguments' JSON reads
])
def test_tool_call_arguments_read_as_a_body_is(url, arguments, says):
    """An assistant message's tool-call arguments are JSON text the server reads for the chat template: the
    same bounds as the body's own JSON apply."""
    call = {'id': 'c1', 'type': 'function', 'function': {'name': 'f', 'arguments': arguments}}
    messages = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': None, 'tool_calls': [call]},
                {'role': 'tool', 'tool_call_id': 'c1', 'content': 'r'}]
    response = httpx.post(f'{url}/v1/chat/completions', json={**CHAT, 'messages': messages}, timeout=60)
    assert says in _error(response, 'messages.1.tool_calls.0.function.arguments')


def test_extreme_sampling_values_do_not_fail_other_requests(url):
    """A denormal temperature or a tiny repetition penalty made NaN weights: the step failed, and with it every
    request batched alongside (500s)."""
    hostile = [{'temperature': 5e-324}, {'temperature': 1e-38, 'top_p': 0.5}, {'repetition_penalty': 1e-300},
               {'repetition_penalty': 1e-300, 'temperature': 2e-5, 'top_k': 3}]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            normal = asyncio.create_task(http.post('/v1/chat/completions', json={
                **CHAT, 'max_tokens': 30, 'ignore_eos': True, 'temperature': 0}))
            await asyncio.sleep(0.1)
            bad = await asyncio.gather(*(http.post('/v1/chat/completions', json={**CHAT, 'max_tokens': 8, **h})
                                         for h in hostile))
            return await normal, bad

    normal, bad = asyncio.run(main())
    assert normal.status_code == 200 and normal.json()['usage']['completion_tokens'] == 30, normal.text
    assert [r.status_code for r in bad] == [200] * len(hostile), [r.text for r in bad]


@pytest.mark.parametrize('stream', [False, True])
def test_seed_range(url, stream):
    """A seed torch cannot take was a late, unclear error ("Overflow when unpacking long long"; a 200 with an
    error event when streaming)."""
    body = {**CHAT, 'temperature': 1.0, 'stream': stream}
    for seed in (2 ** 64, -2 ** 63 - 1, 10 ** 100):
        _error(httpx.post(f'{url}/v1/chat/completions', json={**body, 'seed': seed}), 'seed')
    assert httpx.post(f'{url}/v1/chat/completions', json={**body, 'seed': 2 ** 64 - 1, 'n': 2}).status_code == 200


@pytest.mark.parametrize('key', ['5_0', ' 5', '٣', '+5', '0x5',
                                 pytest.param('1' * 4301, id='more digits than int() reads')])
def test_logit_bias_keys_are_decimal_token_ids(url, key):
    _error(httpx.post(f'{url}/v1/chat/completions', json={**CHAT, 'logit_bias': {key: 1}}), 'logit_bias')


def test_token_limits_name_the_field(url):
    for field in ('max_tokens', 'max_completion_tokens'):
        message = _error(httpx.post(f'{url}/v1/chat/completions', json={**CHAT, field: 2 ** 64}), field)
        assert '1048576' in message


def test_a_format_slow_to_compile_is_400_and_others_go_on(url):
    """A schema can take long to compile (20,000 enum values: seconds even on the tiny vocabulary): the request
    waited for it, on a thread of the event loop's default executor. Now it is refused at the limit and its
    compile killed (see test_grammar_limits.py, also for length bounds, which no longer take long)."""
    slow = {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {
        'enum': [f'value number {i}' for i in range(20_000)]}}}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            warm = await http.post('/v1/chat/completions', json={**CHAT, 'response_format': {
                'type': 'json_schema', 'json_schema': {'name': 'n', 'schema': {'type': 'integer'}}}})
            assert warm.status_code == 200, warm.text  # the grammar workers' start is not timed here
            start = time.monotonic()
            compiling = asyncio.create_task(http.post('/v1/chat/completions', json={**CHAT, 'response_format': slow}))
            await asyncio.sleep(0.2)
            other = await http.post('/v1/chat/completions', json={**CHAT, 'response_format': {'type': 'json_object'}})
            return await compiling, time.monotonic() - start, other

    refused, seconds, other = asyncio.run(main())
    assert 'did not compile within 1 s' in _error(refused, 'response_format') and seconds < 4
    assert refused.json()['error']['code'] == 'max_grammar_compile_seconds_exceeded'
    assert other.status_code == 200, other.text


@pytest.mark.parametrize('field', ['tools', 'tool_calls', 'chat_template_kwargs'])
def test_what_the_chat_template_renders_counts_against_max_prompt_chars(url, field):
    """Tool definitions, tool-call arguments and template variables go into the prompt too: 10 MB of a tool's
    description took 42 s of a preprocessing thread to tokenize (here with a Hermes template), past
    --max-prompt-chars."""
    text = 'word ' * 200_001
    body = {**CHAT, 'tools': [{'type': 'function', 'function': {'name': 'f', 'description': text}}],
            'tool_choice': 'none'}
    if field == 'tool_calls':
        call = {'id': 'c', 'type': 'function', 'function': {'name': 'f', 'arguments': text}}
        body = {**CHAT, 'messages': [{'role': 'assistant', 'content': '', 'tool_calls': [call]}]}
    elif field == 'chat_template_kwargs':
        body = {**CHAT, 'chat_template_kwargs': {'notes': text}}
    response = httpx.post(f'{url}/v1/chat/completions', json=body)
    assert response.status_code == 400 and response.json()['error']['code'] == 'max_prompt_chars_exceeded'
