"""Bounded input and admission (issue 18): per-request limits, fan-out slots, admit before heavy work,
and an overloaded server that sheds load with cheap 429s."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from server_helpers import ServerThread, slow_down, tiny_engine

from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.serve.inst_manager import InferInstManager
from lmdeploy.serve.openai.admission import Admission
from lmdeploy.serve.openai.api_server import create_app
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.limits import RequestLimits
from lmdeploy.serve.openai.request_start import admitted
from lmdeploy.serve.openai.serving_common import ServerState
from lmdeploy.serve.session_manager import Request, SessionManager

LIMITS = RequestLimits(max_request_body_bytes=4096, max_messages=3, max_prompt_chars=200, max_stop_sequences=2,
                       max_stop_length=8, max_stop_token_ids=2, max_fanout=8)
MSG = [{'role': 'user', 'content': 'Hello world'}]


class Calls:
    """Wraps ``obj.name`` (an instance attribute), recording the thread of each call."""

    def __init__(self, obj, name):
        self.threads: list[str] = []
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            self.threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        setattr(obj, name, wrapper)

    def __len__(self):
        return len(self.threads)


@pytest.fixture(scope='module')
def engine(tiny_llama):
    engine = tiny_engine(tiny_llama, num_gpu_blocks=128)
    slow_down(engine, 0.02)
    yield engine
    engine.close()


@pytest.fixture(scope='module')
def limited(engine):
    """Tight limits; 4 running slots, no queue."""
    server = ServerThread(create_app(engine, model_name='tiny', max_concurrent_requests=4, max_queue_size=0,
                                     limits=LIMITS))
    yield server
    server.stop()


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()['error']


def _limit_error(resp: httpx.Response, name: str, value: int, status: int = 400) -> dict:
    err = _error(resp, status)
    assert err['code'] == f'{name}_exceeded'
    assert '--' + name.replace('_', '-') in err['message'] and f'is {value})' in err['message'], err
    return err


def test_body_limit_content_length_and_chunked(limited):
    url = limited.url
    big = {'model': 'tiny', 'messages': MSG, 'user': 'x' * 5000}
    _limit_error(httpx.post(f'{url}/v1/chat/completions', json=big), 'max_request_body_bytes', 4096, 413)

    def chunks(n):
        body = b'{"input": "' + b'a' * n + b'"}'
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]
    resp = httpx.post(f'{url}/v1/encode', content=chunks(20000), headers={'Content-Type': 'application/json'})
    assert 'content-length' not in resp.request.headers and resp.request.headers['transfer-encoding'] == 'chunked'
    _limit_error(resp, 'max_request_body_bytes', 4096, 413)
    ok = httpx.post(f'{url}/v1/encode', content=chunks(150), headers={'Content-Type': 'application/json'})
    assert ok.status_code == 200 and ok.json()['length'] > 0
    assert httpx.get(f'{url}/health').status_code == 200


def test_message_prompt_and_stop_limits(limited):
    client = openai.OpenAI(base_url=f'{limited.url}/v1', api_key='x', max_retries=0)
    chat = client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as exc:
        chat(model='tiny', messages=MSG * 4, max_tokens=2)
    assert exc.value.code == 'max_messages_exceeded' and '--max-messages is 3' in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        chat(model='tiny', messages=[{'role': 'user', 'content': [{'type': 'text', 'text': 'a' * 150}]},
                                     {'role': 'user', 'content': 'b' * 51}], max_tokens=2)
    assert exc.value.code == 'max_prompt_chars_exceeded' and '--max-prompt-chars is 200' in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model='tiny', prompt=['a' * 100, 'b' * 101], max_tokens=2)
    assert exc.value.code == 'max_prompt_chars_exceeded'
    with pytest.raises(openai.BadRequestError) as exc:
        chat(model='tiny', messages=MSG, max_tokens=2, stop=['a', 'b', 'c'])
    assert exc.value.code == 'max_stop_sequences_exceeded'
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model='tiny', prompt='Hello', max_tokens=2, stop='123456789')
    assert exc.value.code == 'max_stop_length_exceeded' and '--max-stop-length is 8' in exc.value.message
    url = limited.url
    body = {'model': 'tiny', 'messages': MSG, 'max_tokens': 2, 'stop_token_ids': [1, 2, 3]}
    _limit_error(httpx.post(f'{url}/v1/chat/completions', json=body), 'max_stop_token_ids', 2)
    _limit_error(httpx.post(f'{url}/generate', json={'prompt': 'x' * 201, 'max_tokens': 2}), 'max_prompt_chars', 200)
    _limit_error(httpx.post(f'{url}/v1/encode', json={'input': ['a'] * 9}), 'max_fanout', 8)
    ok = chat(model='tiny', messages=MSG * 3, max_tokens=2, stop=['a', '12345678'], extra_body={'ignore_eos': True})
    assert ok.choices[0].finish_reason in ('length', 'stop')


def test_fanout_limit_and_capacity(limited):
    url = limited.url
    body = {'model': 'tiny', 'prompt': ['Hello', 'world', 'fox'], 'n': 3, 'max_tokens': 2}
    err = _limit_error(httpx.post(f'{url}/v1/completions', json=body), 'max_fanout', 8)
    assert '3 x 3' in err['message']
    ids = {'model': 'tiny', 'prompt': [[5, 6, 7]] * 9, 'max_tokens': 2}
    _limit_error(httpx.post(f'{url}/v1/completions', json=ids), 'max_fanout', 8)
    # 5 slots fit the fan-out limit (8) but never the 4 running slots: a 400 at once, not a wait or a 429.
    err = _error(httpx.post(f'{url}/v1/chat/completions', json={'model': 'tiny', 'messages': MSG, 'n': 5,
                                                                  'max_tokens': 2}), 400)
    assert err['code'] == 'max_concurrent_requests_exceeded' and '--max-concurrent-requests is 4' in err['message']
    ok = httpx.post(f'{url}/v1/completions', json={**body, 'prompt': ['Hello', 'world'], 'n': 2}, timeout=60)
    assert ok.status_code == 200 and sorted(c['index'] for c in ok.json()['choices']) == [0, 1, 2, 3]


def test_fanout_takes_admission_slots_and_work_comes_after_admission(limited, engine):
    """A running n=3 request holds 3 of the 4 slots: n=2 gets a 429 before its prompt is tokenized,
    its images fetched or its echo prefill run; n=1 still fits. Admitted work runs on the executor, and the
    echo's prompt logprobs come from the request's own prefill, scheduled like any other."""
    url = limited.url
    process, encode, logits = (Calls(engine.processor, 'process'), Calls(engine, 'encode'),
                               Calls(engine, 'get_logits'))
    try:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                long = {'model': 'tiny', 'messages': MSG, 'n': 3, 'max_tokens': 40, 'ignore_eos': True}
                first = asyncio.create_task(http.post('/v1/chat/completions', json=long))
                for _ in range(200):
                    await asyncio.sleep(0.02)
                    if limited.app.state.server.admission.running == 3:
                        break
                assert limited.app.state.server.admission.running == 3
                assert len(process) == 1 and process.threads[0].startswith('lmdeploy-preprocess')
                busy_chat = await http.post('/v1/chat/completions', json={**long, 'n': 2})
                busy_echo = await http.post('/v1/completions', json={
                    'model': 'tiny', 'prompt': ['Hello', 'world'], 'echo': True, 'logprobs': 1, 'max_tokens': 2})
                assert len(process) == 1 and len(encode) == 0 and len(logits) == 0
                one = await http.post('/v1/completions', json={'model': 'tiny', 'prompt': 'Hello', 'echo': True,
                                                              'logprobs': 1, 'max_tokens': 2})
                return busy_chat, busy_echo, one, await first

        busy_chat, busy_echo, one, first = asyncio.run(main())
    finally:
        for name in ('encode', 'get_logits'):
            del engine.__dict__[name]
        del engine.processor.__dict__['process']
    for resp in busy_chat, busy_echo:
        assert _error(resp, 429)['type'] == 'requests' and resp.headers['retry-after'] == '1'
    assert one.status_code == 200 and one.json()['choices'][0]['text'].startswith('Hello')
    assert len(encode) == 1 and encode.threads[0].startswith('lmdeploy-preprocess')
    assert len(logits) == 0, "the echo's prompt logprobs come from the request's own (scheduled) prefill"
    assert one.json()['choices'][0]['logprobs']['token_logprobs'][0] is None
    assert first.status_code == 200 and len(first.json()['choices']) == 3
    assert limited.app.state.server.admission.running == 0


def test_overload_sheds_excess_quickly(engine):
    """30 concurrent clients against 2 running + 2 waiting slots: 4 are served, 26 get a 429 quickly,
    and nothing else queues or is tokenized."""
    app = create_app(engine, model_name='tiny', max_concurrent_requests=2, max_queue_size=2)
    server = ServerThread(app)
    admission = app.state.server.admission
    process = Calls(engine.processor, 'process')
    peak = {'waiting': 0, 'insts': 0}
    try:
        async def one(client):
            start = time.monotonic()
            try:
                await client.chat.completions.create(model='tiny', messages=MSG, max_tokens=30,
                                                     extra_body={'ignore_eos': True})
                return 200, time.monotonic() - start
            except openai.RateLimitError:
                return 429, time.monotonic() - start

        async def main():
            client = openai.AsyncOpenAI(base_url=f'{server.url}/v1', api_key='x', max_retries=0, timeout=120)
            tasks = [asyncio.create_task(one(client)) for _ in range(30)]
            while not all(t.done() for t in tasks):
                peak['waiting'] = max(peak['waiting'], admission.num_waiting)
                peak['insts'] = max(peak['insts'], engine.inst_manager.num_waiting)
                await asyncio.sleep(0.005)
            await client.close()
            return [t.result() for t in tasks]

        start = time.monotonic()
        results = asyncio.run(main())
        total = time.monotonic() - start
    finally:
        del engine.processor.__dict__['process']
        server.stop()
    codes = [code for code, _ in results]
    assert codes.count(200) == 4 and codes.count(429) == 26, codes
    slowest_429 = max(t for code, t in results if code == 429)
    fastest_200 = min(t for code, t in results if code == 200)
    assert slowest_429 < fastest_200 and slowest_429 < total / 2, (slowest_429, fastest_200, total)
    assert len(process) == 4  # rejected requests were never templated or tokenized
    assert peak['waiting'] <= 2 and peak['insts'] <= 2
    assert admission.running == 0 and admission.num_waiting == 0


def test_admission_counts_slots_fifo():
    admission = Admission(max_running=4, max_waiting=3)

    async def main():
        a = await admission.acquire(3)
        waiter = asyncio.create_task(admission.acquire(2))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as exc:
            await admission.acquire(2)  # 2 + 2 waiting slots > 3
        assert exc.value.status == 429
        small = asyncio.create_task(admission.acquire(1))  # fits the running slots, but waits its turn (FIFO)
        await asyncio.sleep(0)
        assert admission.num_waiting == 2 and admission.running == 3
        with pytest.raises(APIError) as exc:
            await admission.acquire(5)
        assert exc.value.status == 400
        a.release()
        a.release()  # idempotent
        b, c = await waiter, await small
        assert admission.running == 3 and admission.num_waiting == 0
        b.release()
        c.release()
        blocked = await admission.acquire(4)
        cancelled = asyncio.create_task(admission.acquire(1))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert admission.num_waiting == 0 and admission.waiting_slots == 0
        blocked.release()
    asyncio.run(main())
    assert admission.running == 0


class Sessions:
    """The session bookkeeping of an ``AsyncEngine`` (``reserve``, ``release``), without a model."""

    def __init__(self):
        self.session_manager = SessionManager()
        self.reserve = self.session_manager.reserve
        self.release = self.session_manager.release


async def connected() -> dict:
    """The ``receive`` of a client that never leaves."""
    await asyncio.Event().wait()


def test_admitted_gives_the_slots_back_unless_the_run_started():
    """Slots and sessions taken for a request that fails (or is cancelled, or returns) before its run started go
    back; a started run takes them over (here a stand-in that only records that)."""
    state = ServerState(engine=Sessions(), model_name='tiny', admission=Admission(max_running=2, max_waiting=0),
                        metrics=None)
    sessions = state.engine.session_manager.sessions

    async def preparing(error: BaseException | None, session_id: int | None = None):
        async with admitted(state, 1 if session_id is not None else 2, session_id, connected):
            assert len(sessions) == (1 if session_id is not None else 2)
            if error is not None:
                raise error

    async def main():
        with pytest.raises(APIError):
            await preparing(APIError(400, 'the prompt is too long'))
        with pytest.raises(asyncio.CancelledError):
            await preparing(asyncio.CancelledError(), session_id=7)
        await preparing(None)
        assert state.admission.running == 0 and not sessions
        async with admitted(state, 2, None, connected) as request:
            request.run = 'started'
        assert state.admission.running == 2 and not request.ticket.released
        assert len(request.reservations) == len(sessions) == 2
        with pytest.raises(APIError, match='busy'):  # no slot left: the session it took goes back
            await preparing(AssertionError('admitted past a full server'), session_id=7)
        assert len(sessions) == 2
        request.ticket.release()
        for reservation in request.reservations:
            state.engine.release(reservation)
    asyncio.run(main())
    assert state.admission.running == 0 and not sessions


def test_instance_waiters_are_bounded():
    manager = InferInstManager(engine_loop=None, size=1, max_waiting=1)

    async def main():
        inst = await manager.acquire(Request(0))
        waiter = asyncio.create_task(manager.acquire(Request(0)))
        await asyncio.sleep(0.01)
        with pytest.raises(SafeRunException) as overloaded:
            await manager.acquire(Request(0))
        assert overloaded.value.code is ErrorCode.SERVER_OVERLOADED and overloaded.value.code.http_status == 503
        assert manager.num_waiting == 1
        manager.release(inst)
        manager.release(await waiter)
    asyncio.run(main())
    assert manager.num_busy == 0 and manager.num_waiting == 0
