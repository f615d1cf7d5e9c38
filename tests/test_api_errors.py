"""Errors of the OpenAI-compatible server: OpenAI-style bodies, statuses, auth, CORS, back-pressure."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_helpers import serve, slow_down, tiny_engine


CHAT = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()['error']
    assert set(error) == {'message', 'type', 'param', 'code'}
    return error


@pytest.mark.parametrize('patch, param', [
    ({'temperature': 5}, 'temperature'), ({'top_p': 0}, 'top_p'), ({'n': 0}, 'n'), ({'max_tokens': 0}, 'max_tokens'),
    ({'messages': []}, 'messages'), ({'messages': 'hi'}, 'messages'), ({'top_k': -2}, 'top_k'),
    ({'logit_bias': {'x': 1}}, 'logit_bias'), ({'logit_bias': {'5': 1000}}, 'logit_bias'),
    ({'stop_token_ids': [10 ** 6]}, 'stop_token_ids'), ({'session_id': -1}, 'session_id'),
    ({'min_tokens': 10}, 'min_tokens'), ({'stream_options': {'include_usage': True}}, 'stream_options'),
    ({'top_logprobs': 2}, 'top_logprobs'), ({'tools': [{'type': 'function'}]}, 'tools.0.function'),
    ({'response_format': {'type': 'xml'}}, 'response_format.type'),
    ({'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x'}}}, 'response_format.json_schema'),
    ({'messages': [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'x'}}]}]}, 'messages'),
])
def test_invalid_values_are_400(api_server, patch, param):
    error = _error(httpx.post(f'{api_server.url}/v1/chat/completions', json={**CHAT, **patch}), 400)
    assert error['param'] == param and error['type'] == 'invalid_request_error'


def test_images_json_model_and_length(api_server):
    url = api_server.url
    image = {**CHAT, 'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 'see'},
                                                              {'type': 'image_url', 'image_url': {'url': 'x'}}]}]}
    assert 'does not accept images' in _error(httpx.post(f'{url}/v1/chat/completions', json=image), 400)['message']
    assert _error(httpx.post(f'{url}/v1/chat/completions', json={**CHAT, 'model': 'gpt-4'}), 404)['code'] == \
        'model_not_found'
    bad = httpx.post(f'{url}/v1/chat/completions', content=b'{"model": "tiny",',
                     headers={'content-type': 'application/json'})
    assert 'JSON' in _error(bad, 400)['message']
    long = httpx.post(f'{url}/v1/completions', json={'model': 'tiny', 'prompt': [5] * 2000})
    assert '1024' in _error(long, 400)['message']
    long_text = httpx.post(f'{url}/v1/completions', json={'model': 'tiny', 'prompt': 'Hello world ' * 1000})
    assert _error(long_text, 400)['code'] == 'context_length_exceeded'
    assert _error(httpx.post(f'{url}/generate', json={'prompt': 'a', 'input_ids': [1]}), 400)['param'] == 'prompt'
    assert _error(httpx.post(f'{url}/abort_request', json={}), 400)['param'] == 'session_id'


def test_openai_client_raises_bad_request(api_server):
    client = openai.OpenAI(base_url=f'{api_server.url}/v1', api_key='none', max_retries=0)
    with pytest.raises(openai.BadRequestError, match='json_schema'):
        client.chat.completions.create(model='tiny', messages=CHAT['messages'],
                                       response_format={'type': 'json_schema', 'json_schema': {'name': 'x'}})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model='nope', prompt='hi')


def _raised(call, *args, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call(*args, **kwargs)
    return caught.value


def _openai_fields(err: openai.APIStatusError) -> tuple:
    assert (err.type, err.code, err.param) == (err.body['type'], err.body['code'], err.body['param'])
    return type(err), err.body['type'], err.code, err.param


def test_error_types_are_openais(api_server):
    """``type`` is OpenAI's (``invalid_request_error`` for a 4xx, 404 included), and ``code`` says what went wrong,
    as the official client reads them. Was ``not_found_error`` for an unknown model, and a 404 of an unknown path
    had no ``code``."""
    client = openai.OpenAI(base_url=f'{api_server.url}/v1', api_key='none', max_retries=0)
    chat, completions = client.chat.completions.create, client.completions.create
    bad = 'invalid_request_error'
    assert _openai_fields(_raised(chat, model='tiny', messages=CHAT['messages'], temperature=5)) == (
        openai.BadRequestError, bad, 'invalid_argument', 'temperature')
    assert _openai_fields(_raised(chat, model='gpt-4', messages=CHAT['messages'])) == (
        openai.NotFoundError, bad, 'model_not_found', 'model')
    assert _openai_fields(_raised(completions, model='tiny', prompt='Hello world ' * 1000)) == (
        openai.BadRequestError, bad, 'context_length_exceeded', 'prompt')
    assert _openai_fields(_raised(chat, model='tiny', messages=[{'role': 'user', 'content': 'Hello world ' * 1000}])) \
        == (openai.BadRequestError, bad, 'context_length_exceeded', 'messages')
    assert _openai_fields(_raised(chat, model='tiny', messages=CHAT['messages'], extra_body={'bad_words': ['x']})) \
        == (openai.BadRequestError, bad, 'unsupported_value', 'bad_words')
    malformed = _raised(client.post, '/chat/completions', cast_to=httpx.Response, content=b'{"model": "tiny",',
                        options={'headers': {'Content-Type': 'application/json'}})
    assert _openai_fields(malformed) == (openai.BadRequestError, bad, 'invalid_argument', None)
    assert _openai_fields(_raised(client.get, '/nowhere', cast_to=httpx.Response)) == (
        openai.NotFoundError, bad, 'not_found', None)


def test_occupied_session_is_400(api_server):
    manager = api_server.engine.session_manager
    session = manager.create(4242)
    request = manager.start_request(session)
    try:
        body = {'input_ids': [5, 6, 7], 'session_id': 4242, 'max_tokens': 4}
        assert _error(httpx.post(f'{api_server.url}/generate', json=body), 400)['code'] == 'session_occupied'
    finally:
        manager.finish_request(session, request, end_session=True)
    assert httpx.post(f'{api_server.url}/generate', json=body).json()['finish_reason'] == 'length'


@pytest.fixture(scope='module')
def guarded(tiny_llama):
    """A server with API keys, CORS, and room for one running and one waiting request."""
    engine = tiny_engine(tiny_llama, num_gpu_blocks=64)
    slow_down(engine, 0.01)
    yield from serve(engine, model_name='tiny', api_keys=['k1', 'k2'], admin_api_keys=['admin'],
                     allow_origins=['http://example.com'], max_concurrent_requests=1, max_queue_size=1)


def test_auth_and_cors(guarded):
    url = guarded.url
    assert _error(httpx.get(f'{url}/v1/models'), 401)['code'] == 'invalid_api_key'
    assert httpx.get(f'{url}/v1/models', headers={'Authorization': 'Bearer nope'}).status_code == 401
    assert httpx.get(f'{url}/v1/models', headers={'Authorization': 'Bearer k2'}).status_code == 200
    assert httpx.get(f'{url}/health').status_code == 200
    client = openai.OpenAI(base_url=f'{url}/v1', api_key='k1', max_retries=0)
    assert client.models.list().data[0].id == 'tiny'
    wrong = openai.OpenAI(base_url=f'{url}/v1', api_key='bad', max_retries=0)
    for headers in ({}, {'Authorization': openai.Omit()}):  # a wrong key, none
        denied = _raised(wrong.models.list, extra_headers=headers)
        assert _openai_fields(denied) == (openai.AuthenticationError, 'invalid_request_error', 'invalid_api_key', None)
    preflight = httpx.options(f'{url}/v1/chat/completions', headers={
        'Origin': 'http://example.com', 'Access-Control-Request-Method': 'POST'})
    assert preflight.headers['access-control-allow-origin'] == 'http://example.com'


def test_back_pressure_429(guarded):
    headers = {'Authorization': 'Bearer k1'}
    body = {'input_ids': [5, 6, 7], 'max_tokens': 60, 'ignore_eos': True}

    async def main():
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=60) as http:
            first = asyncio.create_task(http.post('/generate', json=body))
            await asyncio.sleep(0.3)
            second = asyncio.create_task(http.post('/generate', json=body))
            await asyncio.sleep(0.3)
            third = await http.post('/generate', json=body)
            return third, await first, await second

    third, first, second = asyncio.run(main())
    refused = _error(third, 429)
    assert (refused['type'], refused['code']) == ('requests', 'rate_limit_exceeded'), refused
    assert third.headers['retry-after'] == '1'
    assert first.status_code == second.status_code == 200
    m = guarded.metrics(headers)
    assert m['lmdeploy:num_requests_running'] == 0 and m['lmdeploy:num_requests_waiting'] == 0


def test_requests_waiting_for_admission_are_aborted(guarded):
    """A request queued behind a running one already holds its session: an abort by its session_id (with the
    key that sent it) ends it before it runs, another key gets a 403, and a second request for that session a
    400 ``session_occupied``; a request refused (429) leaves its session free. ``abort_all`` ends the queued
    requests too, those without a session_id included."""
    k1, k2, admin = ({'Authorization': f'Bearer {key}'} for key in ('k1', 'k2', 'admin'))
    body = {'input_ids': [5, 6, 7], 'max_tokens': 2000, 'ignore_eos': True}

    async def main():
        async with httpx.AsyncClient(base_url=guarded.url, headers=k1, timeout=60) as http:
            async def queue(**fields) -> asyncio.Task:
                task = asyncio.create_task(http.post('/generate', json={**body, **fields}))
                await asyncio.sleep(0.3)
                assert not task.done()
                return task

            running = await queue(session_id=30)
            by_id = await queue(session_id=31)
            occupied = await http.post('/generate', json={**body, 'session_id': 31})
            assert _error(occupied, 400)['code'] == 'session_occupied'
            assert _error(await http.post('/generate', json={**body, 'session_id': 32}), 429)  # the queue is full
            assert _error(await http.post('/abort_request', json={'session_id': 31}, headers=k2), 403)
            assert (await http.post('/abort_request', json={'session_id': 31})).json() == {'success': True}
            by_id = (await by_id).json()
            anonymous = await queue()
            assert (await http.post('/abort_request', json={'abort_all': True}, headers=admin)).json() == {
                'success': True}
            return (await running).json(), by_id, (await anonymous).json()

    running, *queued = asyncio.run(main())
    assert running['finish_reason'] == 'abort' and 0 < running['generate_tokens'] < 2000
    assert [(r['finish_reason'], r['generate_tokens']) for r in queued] == [('abort', 0), ('abort', 0)]
    engine = guarded.engine
    assert not engine.session_manager.sessions and engine.inst_manager.num_busy == 0


@pytest.mark.parametrize('path, queued', [
    ('/generate', {'input_ids': [5, 6, 7], 'max_tokens': 2, 'ignore_eos': True}),
    ('/v1/encode', {'input': 'hello'}),
])
def test_a_client_that_leaves_the_admission_line_frees_its_place(guarded, path, queued):
    """A client that gives up while its request waits for admission takes its place in line with it: the next
    request waits there (no 429) and is served (``/v1/encode`` holds no session, but takes a slot too)."""
    headers = {'Authorization': 'Bearer k1'}
    body = {'input_ids': [5, 6, 7], 'max_tokens': 2000, 'ignore_eos': True}

    async def main():
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=60) as http:
            running = asyncio.create_task(http.post('/generate', json={**body, 'session_id': 40}))
            await asyncio.sleep(0.3)
            with pytest.raises(httpx.ReadTimeout):
                await http.post(path, json=queued, timeout=0.3)
            await asyncio.sleep(0.2)
            served = asyncio.create_task(http.post(path, json=queued))
            await asyncio.sleep(0.3)
            assert not served.done(), (await served).text
            await http.post('/abort_request', json={'session_id': 40})
            return (await running).json(), await served

    running, served = asyncio.run(main())
    assert running['finish_reason'] == 'abort' and served.status_code == 200
    answer = served.json()
    assert answer['length'] > 0 if path == '/v1/encode' else answer['finish_reason'] == 'length'
    assert not guarded.engine.session_manager.sessions


def test_a_request_without_session_id_never_holds_an_id_a_client_may_name(guarded):
    """The sessions of requests without ``session_id`` have ids no client can send, so a client's own free
    ``session_id`` is never refused as occupied because of other traffic."""
    k1, admin = {'Authorization': 'Bearer k1'}, {'Authorization': 'Bearer admin'}
    body = {'input_ids': [5, 6, 7], 'max_tokens': 2000, 'ignore_eos': True}
    sessions = guarded.engine.session_manager.sessions

    async def main():
        async with httpx.AsyncClient(base_url=guarded.url, headers=k1, timeout=60) as http:
            anonymous = asyncio.create_task(http.post('/generate', json=body))
            await asyncio.sleep(0.3)
            (held,) = list(sessions)
            named = asyncio.create_task(http.post('/generate', json={**body, 'session_id': max(held, 0)}))
            await asyncio.sleep(0.3)
            assert not named.done(), (await named).text  # waiting for admission, not refused
            await http.post('/abort_request', json={'abort_all': True}, headers=admin)
            return (await anonymous).json(), (await named).json()

    anonymous, named = asyncio.run(main())
    assert anonymous['finish_reason'] == named['finish_reason'] == 'abort' and not sessions
