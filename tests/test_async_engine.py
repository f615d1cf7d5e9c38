"""AsyncEngine on the real engine (tiny Llama): lifecycle, aborts under load, limits, errors."""
from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from contextlib import aclosing

import psutil
import pytest
from helpers import assert_all_released, engine_state, random_prompts

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.engine_loop import RequestStream, _put_all
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException

GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)


def make_async_engine(path, **kwargs) -> AsyncEngine:
    config = dict(dtype='float32', num_gpu_blocks=64, block_size=16, max_batch_size=16, session_len=256)
    return AsyncEngine(path, PytorchEngineConfig(**{**config, **kwargs}), show_progress=False)


@pytest.fixture(scope='module')
def engine(tiny_llama):
    engine = make_async_engine(tiny_llama)
    yield engine
    engine.close()


async def consume(agen) -> list:
    async with aclosing(agen) as chunks:
        return [chunk async for chunk in chunks]


def test_generate_streams_increments(engine):
    chunks = asyncio.run(consume(engine.generate('Hello world!', gen_config=GEN)))
    assert [c.finish_reason for c in chunks] == [None] * 5 + ['length']
    assert [c.generate_token_len for c in chunks] == list(range(1, 7))
    assert all(len(c.token_ids) == 1 and c.input_token_len == chunks[0].input_token_len for c in chunks)
    assert_all_released(engine)


def test_outputs_of_a_step_wake_their_loop_once(engine):
    batches = []

    async def main() -> list:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if callback is _put_all:
                batches.append(len(args[0]))
            return call_soon_threadsafe(callback, *args, **kwargs)
        loop.call_soon_threadsafe = counting
        return await asyncio.gather(*(consume(engine.generate(f'Hello {i}', gen_config=GEN)) for i in range(4)))
    results = asyncio.run(main())
    assert sum(batches) == sum(len(r) for r in results) == 24 and len(batches) < 24 and max(batches) > 1
    assert_all_released(engine)


def test_aborts_under_load(engine):
    """200 requests; a third are aborted (session abort), cancelled, or closed early: before admission,
    around prefill (right after the start), or mid-decode (after 1 or 2 chunks)."""
    rng = random.Random(0)
    n = 200
    prompts = random_prompts([rng.randint(1, 24) for _ in range(n)], seed=1)
    gens = [GenerationConfig(max_new_tokens=rng.randint(4, 6), ignore_eos=True) for _ in range(n)]
    plan = {i: (rng.choice(['abort', 'cancel', 'close']), rng.randint(0, 2)) for i in rng.sample(range(n), n // 3)}
    finals = {}
    tasks = []

    def interrupt(i: int) -> None:
        if plan[i][0] == 'abort':
            asyncio.ensure_future(engine.abort_session(1000 + i))
        else:
            tasks[i].cancel()

    async def request(i):
        how, at = plan.get(i, (None, None))
        async with aclosing(engine.generate(input_ids=prompts[i], session_id=1000 + i, gen_config=gens[i])) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is not None:
                    finals[i] = chunk
                elif chunk.generate_token_len == at:
                    if how == 'close':
                        return
                    interrupt(i)

    async def main():
        tasks.extend(asyncio.ensure_future(request(i)) for i in range(n))
        await asyncio.sleep(0)  # every request has its session and waits for admission or output
        for i in sorted(plan, key=lambda _: rng.random()):
            if plan[i] in (('abort', 0), ('cancel', 0)):
                interrupt(i)
                await asyncio.sleep(rng.random() * 0.005)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
    asyncio.run(main())
    assert_all_released(engine)
    consumed = [i for i in range(n) if plan.get(i, ('run',))[0] in ('run', 'abort')]
    assert all(i in finals for i in consumed)  # every request still consumed got a finish_reason
    assert all(finals[i].finish_reason == 'length' for i in range(n) if i not in plan)
    # the engine runs ahead of its consumers, so an abort may come after the request already ended
    assert all(finals[i].finish_reason in ('abort', 'length') for i in consumed if i in plan)
    aborted = [finals[i] for i in consumed if i in plan and finals[i].finish_reason == 'abort']
    assert len(aborted) > sum(plan[i][0] == 'abort' for i in plan) / 2
    assert any(r.generate_token_len == 0 for r in aborted) and any(r.generate_token_len > 0 for r in aborted)


def test_cancel_and_break_free_the_request(engine):
    async def main():
        agen = engine.generate('Hello', gen_config=GenerationConfig(max_new_tokens=200, ignore_eos=True))
        async for _ in agen:
            break  # no aclose: the loop's async-generator finalizer closes it
        del agen
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.session_manager.num_active == 0:
                break

        async def run():
            async for _ in engine.generate('Hello', gen_config=GenerationConfig(max_new_tokens=200, ignore_eos=True)):
                started.set()
        started = asyncio.Event()
        task = asyncio.ensure_future(run())
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
    assert_all_released(engine)


def test_abort_semantics(engine):
    async def main():
        await engine.abort_session(424242)  # unknown
        session = engine.session()
        chunks = await consume(engine.generate('Hi', session.session_id, GEN))
        assert chunks[-1].finish_reason == 'length'
        await engine.abort_session(session.session_id)  # finished
        gen = engine.generate('Hi', session.session_id, GenerationConfig(max_new_tokens=500, ignore_eos=True))
        first = await gen.__anext__()
        await engine.abort_session(session.session_id)
        assert engine_state(engine)['sequences'] == 0  # abort is awaited: the engine let go already
        await engine.abort_session(session.session_id)  # twice
        rest = [c async for c in gen]
        assert first.finish_reason is None and rest[-1].finish_reason == 'abort'
        await engine.end_session(session.session_id)
        await engine.end_session(session.session_id)
    asyncio.run(main())
    assert_all_released(engine)


def test_session_occupied(engine):
    async def main():
        session = engine.session()
        gen = engine.generate('Hi', session.session_id, GenerationConfig(max_new_tokens=50, ignore_eos=True))
        await gen.__anext__()
        with pytest.raises(SafeRunException, match='already has a request running') as info:
            await engine.generate('Hi', session.session_id).__anext__()
        assert info.value.code is ErrorCode.SESSION_OCCUPIED
        await gen.aclose()
        await engine.end_session(session.session_id)
    asyncio.run(main())
    assert_all_released(engine)


def test_too_long_prompt_fails_alone(engine):
    prompts = random_prompts([20, 30, 25], seed=3)

    async def run_all(with_long: bool):
        runs = [consume(engine.generate(input_ids=p, gen_config=GEN)) for p in prompts]
        if with_long:
            runs.insert(1, consume(engine.generate(input_ids=list(range(3, 303)), gen_config=GEN)))
        return await asyncio.gather(*runs, return_exceptions=True)
    alone = asyncio.run(run_all(False))
    mixed = asyncio.run(run_all(True))
    error = mixed.pop(1)
    assert isinstance(error, SafeRunException) and error.code is ErrorCode.INPUT_LENGTH_ERROR
    assert 'session_len is 256' in error.message
    tokens = [[t for c in chunks for t in c.token_ids] for chunks in mixed]
    assert tokens == [[t for c in chunks for t in c.token_ids] for chunks in alone]
    assert_all_released(engine)


@pytest.mark.parametrize('kwargs, code, match', [
    ({'input_ids': []}, ErrorCode.INVALID_ARGUMENT, 'empty'),
    ({'input_ids': [10**9]}, ErrorCode.INVALID_ARGUMENT, 'token ids must be in'),
    ({'input_ids': 'abc'}, ErrorCode.INVALID_ARGUMENT, 'list of ints'),
    ({'messages': [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'x'}}]}]},
     ErrorCode.INVALID_ARGUMENT, 'does not accept images'),
    ({'messages': [{'content': 'no role'}]}, ErrorCode.INVALID_ARGUMENT, 'role'),
    ({'messages': 'hi', 'session_id': -3}, ErrorCode.INVALID_ARGUMENT, 'non-negative'),
    ({'messages': 'hi', 'gen_config': GenerationConfig(n=2)}, ErrorCode.INVALID_ARGUMENT, 'n must be 1'),
])
def test_bad_input_raises_before_yielding(engine, kwargs, code, match):
    with pytest.raises(SafeRunException, match=match) as info:
        asyncio.run(consume(engine.generate(**kwargs)))
    assert info.value.code is code
    assert_all_released(engine)


def test_stop_all_session(engine):
    async def main():
        runs = [asyncio.ensure_future(consume(engine.generate(
            f'prompt {i}', gen_config=GenerationConfig(max_new_tokens=400, ignore_eos=True)))) for i in range(40)]
        while engine.inst_manager.num_waiting < 20:
            await asyncio.sleep(0.01)
        await engine.stop_all_session()
        return await asyncio.gather(*runs)
    results = asyncio.run(main())
    assert all(chunks[-1].finish_reason == 'abort' for chunks in results)
    assert sum(chunks[-1].generate_token_len == 0 for chunks in results) >= 20  # queued ones never ran
    assert_all_released(engine)


def test_request_from_an_older_epoch_never_runs(engine):
    async def main():
        stream = RequestStream([5, 6, 7], GEN, epoch=engine.session_manager.epoch - 1)
        engine.engine_loop.submit(stream)
        return await stream.queue.get()
    out = asyncio.run(main())
    assert out.finish_reason == 'abort' and out.num_output_tokens == 0
    assert_all_released(engine)


def test_engine_failure_ends_requests_in_flight_with_error(engine):
    def break_next_forward(e):
        def failing(stage, seqs):
            if stage == 'forward':
                e.fault_hook = None
                raise RuntimeError('injected failure')
        e.fault_hook = failing
    engine.engine_loop.call(break_next_forward).result(10)
    chunks = asyncio.run(consume(engine.generate('Hi', gen_config=GEN)))
    assert chunks[-1].finish_reason == 'error' and 'injected failure' in chunks[-1].error
    assert engine.engine_loop.is_alive
    assert asyncio.run(consume(engine.generate('Hi', gen_config=GEN)))[-1].finish_reason == 'length'
    assert_all_released(engine)


def test_idle_loop_sleeps_and_keeps_a_heartbeat(engine):
    loop = engine.engine_loop
    native_id = loop._thread.native_id

    def cpu_seconds():
        return next(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == native_id)
    before = cpu_seconds()
    time.sleep(0.5)
    assert cpu_seconds() - before < 0.1
    assert loop.is_alive and time.monotonic() - loop.last_heartbeat < 3


def test_engines_do_not_share_sessions_or_instances(engine, tiny_llama):
    other = make_async_engine(tiny_llama, max_batch_size=2)
    try:
        assert other.session_manager is not engine.session_manager
        assert other.inst_manager is not engine.inst_manager and other.inst_manager.size == 2
        mine, theirs = engine.session(7), other.session(7)

        async def main():
            gen = other.generate('Hi', 7, GenerationConfig(max_new_tokens=50, ignore_eos=True))
            await gen.__anext__()
            assert other.session_manager.num_active == 1 and other.inst_manager.num_busy == 1
            assert engine.session_manager.num_active == 0 and engine.inst_manager.num_busy == 0
            await engine.stop_all_session()
            assert (await consume(engine.generate('Hi', 7, GEN)))[-1].finish_reason == 'length'
            await gen.aclose()
        asyncio.run(main())
        assert mine is not theirs and engine.session_manager.epoch != other.session_manager.epoch
        asyncio.run(engine.end_session(7))
    finally:
        other.close()
    assert not other.engine_loop.is_alive
    with pytest.raises(SafeRunException) as info:
        asyncio.run(consume(other.generate('Hi')))
    assert info.value.code is ErrorCode.ABORTED


def test_engine_is_built_on_the_loop_thread_and_build_errors_reach_the_caller(tiny_llama, monkeypatch):
    built_on = []

    class RecordingEngine(Engine):
        def __init__(self, *args, **kwargs):
            built_on.append(threading.current_thread())
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(sys.modules[AsyncEngine.__module__], 'Engine', RecordingEngine)
    engine = make_async_engine(tiny_llama)
    try:
        assert built_on == [engine.engine_loop._thread]
        assert asyncio.run(consume(engine.generate('Hi', gen_config=GEN)))[-1].finish_reason == 'length'
    finally:
        engine.close()
    threads = threading.active_count()
    with pytest.raises(FileNotFoundError, match='does not exist'):
        make_async_engine('/nonexistent/model')
    assert threading.active_count() == threads
