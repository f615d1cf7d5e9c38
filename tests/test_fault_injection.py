"""No request ever hangs: faults injected into the real engine (``Engine.fault_hook``), into one request's
input, and into a server-side producer end only what they hit, through AsyncEngine and through the server."""
from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing, contextmanager

import httpx
import openai
import pytest
from helpers import assert_all_released
from server_helpers import ServerThread, serve, tiny_engine

from lmdeploy.messages import GenerationConfig, Response
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.serve.openai.api_server import create_app

TIMEOUT = 30  # seconds; a request that takes longer hangs
LONG = list(range(40, 56))  # 16 prompt tokens: a whole step's budget under max_prefill_token_num=16
SHORT = [5, 6, 7, 8, 9]


def gen(n: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, ignore_eos=True)


class LoopKilled(BaseException):
    """Not an ``Exception``: nothing in the loop may swallow it, so the engine-loop thread dies."""


def make_engine(path: str, overlap: bool = False, max_prefill_token_num: int = 16) -> AsyncEngine:
    return tiny_engine(path, num_gpu_blocks=64, max_batch_size=4, max_prefill_token_num=max_prefill_token_num,
                       session_len=256, overlap_schedule=overlap)


def set_hook(engine: AsyncEngine, hook) -> None:
    """Installs ``Engine.fault_hook`` on the engine-loop thread, between two steps."""
    engine.engine_loop.call(lambda e: setattr(e, 'fault_hook', hook)).result(10)


@contextmanager
def paused(engine: AsyncEngine):
    """Holds the engine-loop thread between two steps, so that requests sent meanwhile start together."""
    entered, gate = threading.Event(), threading.Event()
    engine.engine_loop.call(lambda e: (entered.set(), gate.wait(TIMEOUT)))
    assert entered.wait(10)
    try:
        yield
    finally:
        gate.set()


async def wait_busy(engine: AsyncEngine, n: int) -> None:
    """Until ``n`` requests hold an engine instance (they are queued for the loop)."""
    async with asyncio.timeout(10):
        while engine.inst_manager.num_busy < n:
            await asyncio.sleep(0.01)


async def run(engine: AsyncEngine, ids: list[int], config: GenerationConfig, **kwargs) -> list[Response]:
    async with aclosing(engine.generate(input_ids=ids, gen_config=config, **kwargs)) as chunks:
        return [chunk async for chunk in chunks]


async def run_together(engine: AsyncEngine, *requests: tuple[list[int], GenerationConfig]) -> list[list[Response]]:
    """Starts the requests in one step of the engine; fails (instead of hanging) after TIMEOUT seconds."""
    with paused(engine):
        tasks = [asyncio.create_task(run(engine, ids, config)) for ids, config in requests]
        await wait_busy(engine, len(requests))
    async with asyncio.timeout(TIMEOUT):
        return await asyncio.gather(*tasks)


def fail_forward(number: int, batches: list, exc: BaseException | None = None):
    """A hook that raises in the ``number``-th forward pass (1-based) and records each batch's prompt lengths."""
    def hook(stage, seqs):
        if stage == 'forward':
            batches.append(sorted(len(seq.prompt_ids) for seq in seqs))
            if len(batches) == number:
                raise exc or RuntimeError('injected forward failure')
    return hook


def fail_after_a_finish(raised: list, exc: BaseException | None = None):
    """A hook that raises once, in the output processing of the first step in which a sequence finished
    (that sequence is already released inside the engine by then)."""
    def hook(stage, seqs):
        if stage == 'output' and not raised and any(seq.finish_reason is not None for seq in seqs):
            raised.append(sorted(seq.num_generated for seq in seqs))
            raise exc or RuntimeError('injected output failure')
    return hook


@pytest.fixture(scope='module', params=[False, True], ids=['plain', 'overlap'])
def engine(request, tiny_llama):
    engine = make_engine(tiny_llama, overlap=request.param)
    assert engine.engine.overlap is request.param
    yield engine
    set_hook(engine, None)
    engine.close()


@pytest.fixture
def hooked(engine):
    """The module's engine; the fault hook a test installs is removed afterwards."""
    yield engine
    if engine.engine_loop.is_alive:
        set_hook(engine, None)


# -- AsyncEngine ---------------------------------------------------------------------------------------------


def test_failed_forward_ends_only_its_batch(hooked):
    """The 1st forward (A's prefill; B waits, the step's token budget spent) fails: A ends as 'error', B is
    served."""
    engine, batches = hooked, []
    set_hook(engine, fail_forward(1, batches))

    async def main():
        a, b = await run_together(engine, (LONG, gen(4)), (SHORT, gen(4)))
        later = await run(engine, SHORT, gen(3))
        return a, b, later
    a, b, later = asyncio.run(main())
    assert batches[:2] == [[len(LONG)], [len(SHORT)]]  # B was not in the failed batch
    assert a[-1].finish_reason == 'error' and 'injected forward failure' in a[-1].error
    assert b[-1].finish_reason == 'length' and sum(len(c.token_ids) for c in b) == 4
    assert later[-1].finish_reason == 'length'
    assert engine.engine_loop.is_alive
    assert_all_released(engine)


def test_failed_forward_mid_generation(hooked):
    """The 3rd forward fails (overlapped, step 2 is still in flight then): A and B end as 'error' after A's
    first tokens, nothing leaks, later requests are served."""
    engine, batches = hooked, []
    set_hook(engine, fail_forward(3, batches))

    async def main():
        return await run_together(engine, (SHORT, gen(8)), (LONG, gen(8))), await run(engine, SHORT, gen(3))
    (a, b), later = asyncio.run(main())
    assert batches[2] == [len(SHORT), len(LONG)]
    for chunks in a, b:
        assert chunks[-1].finish_reason == 'error' and 'injected forward failure' in chunks[-1].error
        assert chunks[-1].generate_token_len < 8
    assert a[-1].generate_token_len >= 1  # A got tokens before the failure
    assert later[-1].finish_reason == 'length'
    assert_all_released(engine)


def test_step_failing_after_a_sequence_finished(hooked):
    """A step fails in its output processing after A (2 tokens) finished in it: A and B end, no hang."""
    engine, raised = hooked, []
    set_hook(engine, fail_after_a_finish(raised))

    async def main():
        return await run_together(engine, (SHORT, gen(2)), (SHORT, gen(8))), await run(engine, SHORT, gen(3))
    (a, b), later = asyncio.run(main())
    assert raised and raised[0][0] == 2  # the failing step finished A
    assert a[-1].finish_reason == 'error' and 'injected output failure' in a[-1].error
    assert b[-1].finish_reason == 'error' and 'injected output failure' in b[-1].error
    assert later[-1].finish_reason == 'length' and later[-1].generate_token_len == 3
    assert engine.engine_loop.is_alive
    assert_all_released(engine)


def test_request_the_engine_cannot_take_ends_alone(hooked, monkeypatch):
    """``add_request`` raises a TypeError (not a ValueError) after it registered the sequence: that request
    ends as 'error', the one running meanwhile goes on, nothing leaks. (``AsyncEngine`` checks a config again
    before it reaches the engine; that check is bypassed here to reach the engine's own defence.)"""
    engine = hooked
    monkeypatch.setattr(engine, '_checked', lambda config: config)
    bad = gen(4)
    bad.stop_words = 5  # set after the checks of GenerationConfig: the engine's stop checker chokes on it

    async def main():
        with paused(engine):  # the running request is added first, the bad one right after it
            running = asyncio.create_task(run(engine, SHORT, gen(30)))
            await wait_busy(engine, 1)
            failing = asyncio.create_task(run(engine, SHORT, bad))
            await wait_busy(engine, 2)
        async with asyncio.timeout(TIMEOUT):
            return await failing, await running, await run(engine, SHORT, gen(3))
    failed, running, later = asyncio.run(main())
    assert [c.finish_reason for c in failed] == ['error'] and 'TypeError' in failed[0].error
    assert running[-1].finish_reason == 'length' and running[-1].generate_token_len == 30
    assert later[-1].finish_reason == 'length'
    assert_all_released(engine)


def test_failed_abort_still_ends_the_request(hooked, monkeypatch):
    engine = hooked
    abort = engine.engine.abort
    calls = []

    def failing_abort(seq_id):
        calls.append(seq_id)
        if len(calls) == 1:
            raise RuntimeError('injected abort failure')
        return abort(seq_id)
    monkeypatch.setattr(engine.engine, 'abort', failing_abort)

    async def main():
        async with asyncio.timeout(TIMEOUT):
            chunks = engine.generate(input_ids=SHORT, gen_config=gen(200))  # far from done at its first chunk
            await chunks.__anext__()
            await chunks.aclose()  # aborts: the engine fails to, the request still ends
            return await run(engine, SHORT, gen(3))
    later = asyncio.run(main())
    assert calls and later[-1].finish_reason == 'length' and engine.engine_loop.is_alive
    monkeypatch.undo()
    engine.engine_loop.call(lambda e: abort(calls[0])).result(10)  # the sequence the failed abort left behind
    assert_all_released(engine)


def test_malformed_multimodal_input_ends_alone(tmp_path):
    from vl_models import save_tiny_vl_model
    engine = make_engine(save_tiny_vl_model('qwen2_vl', str(tmp_path / 'qwen2_vl')))
    try:
        pad = engine.engine.model_config.mm_config.image_token_id
        ids = SHORT + [pad] * 4 + SHORT
        no_grid = MultiModalInput(offset=len(SHORT), length=4, content_hash='x', data={})  # no image_grid_thw

        async def main():
            with pytest.raises(SafeRunException) as info:
                await run(engine, ids, gen(4), multimodal=[{'offset': 5, 'length': 4}])
            assert info.value.code is ErrorCode.INVALID_ARGUMENT
            with paused(engine):  # the running request is added first, the bad one right after it
                running = asyncio.create_task(run(engine, SHORT, gen(20)))
                await wait_busy(engine, 1)
                failing = asyncio.create_task(run(engine, ids, gen(4), multimodal=[no_grid]))
                await wait_busy(engine, 2)
            async with asyncio.timeout(TIMEOUT):
                return await failing, await running, await run(engine, SHORT, gen(3))
        failed, running, later = asyncio.run(main())
        assert [c.finish_reason for c in failed] == ['error'] and 'image_grid_thw' in failed[0].error
        assert running[-1].finish_reason == 'length' and later[-1].finish_reason == 'length'
        assert_all_released(engine)
    finally:
        engine.close()


def test_dead_engine_loop_fails_everything_fast(tiny_llama):
    """The loop thread dies in a step that had just finished A: A and B end, new requests fail at once."""
    engine, raised = make_engine(tiny_llama), []
    try:
        set_hook(engine, fail_after_a_finish(raised, LoopKilled('injected loop death')))

        async def main():
            a, b = await run_together(engine, (SHORT, gen(2)), (SHORT, gen(50)))
            async with asyncio.timeout(5):
                with pytest.raises(SafeRunException) as info:
                    await run(engine, SHORT, gen(3))
            return a, b, info.value
        a, b, refused = asyncio.run(main())
        assert raised
        for chunks in a, b:
            assert chunks[-1].finish_reason == 'error' and 'LoopKilled: injected loop death' in chunks[-1].error
        assert refused.code is ErrorCode.ENGINE_UNAVAILABLE and 'LoopKilled' in refused.message
        assert not engine.engine_loop.is_alive
    finally:
        engine.close()


# -- the server ----------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def server(tiny_llama):
    yield from serve(make_engine(tiny_llama, max_prefill_token_num=256), model_name='tiny')


@pytest.fixture
def server_hooked(server):
    yield server
    set_hook(server.engine, None)


def chat(max_tokens: int, **kwargs) -> dict:
    return {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': max_tokens,
            'ignore_eos': True, **kwargs}


def openai_chat(max_tokens: int, **kwargs) -> dict:
    body = chat(max_tokens, **kwargs)
    body['extra_body'] = {'ignore_eos': body.pop('ignore_eos')}  # a field the openai client does not know
    return body


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{server.url}/v1', api_key='none', timeout=TIMEOUT, max_retries=0)


def test_server_failed_forward_is_a_500_and_the_next_request_is_served(server_hooked):
    server, batches = server_hooked, []
    set_hook(server.engine, fail_forward(1, batches))
    with pytest.raises(openai.InternalServerError, match='injected forward failure'):
        client(server).chat.completions.create(**openai_chat(4))
    set_hook(server.engine, fail_forward(2, []))
    stream = client(server).chat.completions.create(**openai_chat(8), stream=True)
    with pytest.raises(openai.APIError, match='injected forward failure'):
        for _ in stream:
            pass
    reply = client(server).chat.completions.create(**openai_chat(3))
    assert reply.choices[0].finish_reason == 'length' and reply.usage.completion_tokens == 3
    assert httpx.get(f'{server.url}/health').status_code == 200
    assert_all_released(server.engine)


def test_server_step_failing_after_a_sequence_finished(server_hooked):
    server, raised = server_hooked, []
    engine = server.engine
    set_hook(engine, fail_after_a_finish(raised))

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
            with paused(engine):
                posts = [asyncio.create_task(http.post('/v1/chat/completions', json=chat(n))) for n in (2, 8)]
                await wait_busy(engine, 2)
            return await asyncio.gather(*posts)
    replies = asyncio.run(main())
    assert raised
    for reply in replies:
        assert reply.status_code == 500 and 'injected output failure' in reply.json()['error']['message']
    assert client(server).completions.create(model='tiny', prompt='hi', max_tokens=3,
                                             extra_body={'ignore_eos': True}).usage.completion_tokens == 3
    assert_all_released(engine)


def test_server_producer_that_dies_still_ends_its_response(server, monkeypatch):
    """A non-SafeRunException out of ``AsyncEngine.generate`` ends the choice as an error; no hang."""
    async def dying(**kwargs):
        yield Response('x', 1, 3, None, [5])
        raise RuntimeError('injected producer failure')
    monkeypatch.setattr(server.engine, 'generate', dying)
    reply = httpx.post(f'{server.url}/v1/completions', json={'model': 'tiny', 'prompt': 'hi', 'max_tokens': 4, 'n': 2},
                       timeout=TIMEOUT)
    assert reply.status_code == 500 and 'injected producer failure' in reply.json()['error']['message']
    with httpx.stream('POST', f'{server.url}/v1/chat/completions', json=chat(4, stream=True), timeout=TIMEOUT) as r:
        events = [line for line in r.iter_lines() if line.startswith('data: ')]
    assert 'injected producer failure' in events[-2] and events[-1] == 'data: [DONE]'
    monkeypatch.undo()
    assert client(server).completions.create(model='tiny', prompt='hi', max_tokens=3,
                                             extra_body={'ignore_eos': True}).usage.completion_tokens == 3
    assert_all_released(server.engine)


def test_server_dead_engine_loop_fails_fast_and_health_is_503(tiny_llama):
    engine = make_engine(tiny_llama, max_prefill_token_num=256)
    server = ServerThread(create_app(engine, model_name='tiny'))
    try:
        assert httpx.get(f'{server.url}/health').status_code == 200
        raised, stream_events = [], []
        set_hook(engine, fail_after_a_finish(raised, LoopKilled('injected loop death')))

        async def in_flight():
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
                with paused(engine):
                    short = asyncio.create_task(http.post('/v1/chat/completions', json=chat(2)))
                    long = asyncio.create_task(_stream_lines(http, chat(50, stream=True), stream_events))
                    await wait_busy(engine, 2)
                return await short, await long
        short, _ = asyncio.run(in_flight())  # the streaming request's events land in stream_events
        assert raised
        assert short.status_code == 500 and 'LoopKilled' in short.json()['error']['message']
        assert 'LoopKilled' in stream_events[-2] and stream_events[-1] == 'data: [DONE]'
        new = httpx.post(f'{server.url}/v1/chat/completions', json=chat(3), timeout=5)
        assert new.status_code == 503 and 'not running' in new.json()['error']['message']
        health = httpx.get(f'{server.url}/health')
        assert health.status_code == 503 and 'LoopKilled' in health.json()['error']['message']
    finally:
        server.stop()
        engine.close()


async def _stream_lines(http: httpx.AsyncClient, body: dict, out: list) -> None:
    async with http.stream('POST', '/v1/chat/completions', json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith('data: '):
                out.append(line)
