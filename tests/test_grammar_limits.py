"""Response formats whose bounds a client sets: huge string lengths and array sizes compile at once and still give
JSON valid under the schema (no control characters or surrogates in bounded strings); regex patterns whose counted
repetitions would take long to compile are a 400 before any compile; a compile every waiting request gave up is
killed with its worker process; the engines of a process share their workers, and none outlives the last engine."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import jsonschema
import psutil
import pytest
import torch
import xgrammar as xgr
from helpers import assert_gone, make_engine, random_prompts

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.grammar_worker import GrammarProcessPool
from lmdeploy.pytorch.engine.guided import GrammarCompiler, GrammarState
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.tokenizer import Tokenizer

HUGE = {'type': 'object', 'additionalProperties': False, 'required': ['s', 'n'],
        'properties': {'s': {'type': 'string', 'minLength': 2, 'maxLength': 100_000},
                       'n': {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 9},
                             'minItems': 2, 'maxItems': 100_000}}}
LONG_MIN = {'type': 'string', 'minLength': 100_000}
SMALL_CACHE = PytorchEngineConfig(num_gpu_blocks=64)  # not the default 4 GiB: zeroing that takes seconds


def json_schema(schema: dict) -> dict:
    return {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': schema}}


@pytest.fixture(scope='module')
def engine(tiny_llama):
    return make_engine(tiny_llama)


@pytest.fixture(scope='module')
def byte_tokens(engine) -> dict[bytes, int]:
    """The tiny vocabulary's token of each single byte."""
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer.hf, vocab_size=engine.model_config.vocab_size)
    return {b: i for i, b in enumerate(info.decoded_vocab) if len(b) == 1}


def test_huge_bounds_compile_at_once(engine):
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size)
    compiler.compile(GenerationConfig(response_format=json_schema({'type': 'string', 'maxLength': 5})))  # warm-up
    for schema in (HUGE, LONG_MIN, {'type': 'string', 'maxLength': 10 ** 18},
                   {'type': 'array', 'items': {'type': 'string', 'maxLength': 50_000}, 'minItems': 100_000}):
        start = time.perf_counter()
        compiler.compile(GenerationConfig(response_format=json_schema(schema)))
        assert time.perf_counter() - start < 2, schema  # the exact pattern they once became: minutes to hours


@pytest.mark.parametrize('bound', [8, 100_000])
def test_bounded_strings_hold_json_string_characters_only(engine, byte_tokens, bound):
    """xgrammar's own bounded strings let in raw control characters and the UTF-8 bytes of a surrogate (each
    decoded as three characters): whatever the bound, neither gets past the first character, nor does a quote
    before ``minLength`` characters."""
    schema = {'type': 'string', 'minLength': 2, 'maxLength': bound}
    grammar = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size).compile(
        GenerationConfig(response_format=json_schema(schema)))
    for bad in (b'\t', b'\x01', b'\x1f', b'\xed\xa0', b'"', b'\\'):  # \xed\xa0: U+D800's first bytes
        state = GrammarState(grammar)
        for byte in b'"a' + bad[:-1]:
            assert not state.accept(byte_tokens[bytes([byte])], [])
        assert state.accept(byte_tokens[bad[-1:]], []), f'{bad!r} is let in'
    state = GrammarState(grammar)
    for token in (b'"', 'é'.encode()[:1], 'é'.encode()[1:], b'a', b'"'):
        assert not state.matcher.is_terminated() and state.matcher.accept_token(byte_tokens[token])


def test_outputs_of_huge_bounds_validate(engine, byte_tokens):
    """Pushed towards control characters and surrogate bytes (whitespace is JSON outside strings: not pushed),
    greedy and sampled replies still validate."""
    push = {byte_tokens[b]: 30.0 for b in (b'\x01', b'\x1f', b'\xed', b'\xa0', b'\\')}
    push[byte_tokens[b'"']] = 40.0  # ends the string where the grammar lets it
    prompts = random_prompts([9, 12, 7], seed=21)
    requests = [(p, GenerationConfig(max_new_tokens=300, response_format=json_schema(HUGE), logit_bias=push,
                                     do_sample=sampled, temperature=1.0, random_seed=seed))
                for p in prompts for sampled, seed in ((False, 0), (True, 1))]
    ids = {engine.add_request(p, g): i for i, (p, g) in enumerate(requests)}
    texts, finish = [''] * len(requests), [None] * len(requests)
    while engine.has_unfinished():
        for out in engine.step():
            texts[ids[out.seq_id]] += out.text
            finish[ids[out.seq_id]] = out.finish_reason or finish[ids[out.seq_id]]
    for text, reason in zip(texts, finish):
        assert reason == 'stop', (reason, text)
        jsonschema.validate(json.loads(text), HUGE)


SLOW = {'type': 'object', 'properties': {'s': {'type': 'string', 'pattern': '^[a-z]{0,50000}$'}}}
CHAT = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 8}


@pytest.mark.parametrize('field', ['response_format', 'structured_outputs', 'tools'])
def test_a_pattern_over_the_repetition_limit_is_400_at_once(api_server, field):
    body = {**CHAT, 'response_format': json_schema(SLOW)}
    if field == 'structured_outputs':
        body = {**CHAT, 'structured_outputs': {'json': SLOW}}
    elif field == 'tools':
        body = {**CHAT, 'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': SLOW}}],
                'tool_choice': 'required'}
    start = time.monotonic()
    response = httpx.post(f'{api_server.url}/v1/chat/completions', json=body, timeout=60)
    assert time.monotonic() - start < 1 and response.status_code == 400, response.text
    error = response.json()['error']
    assert error['code'] == 'max_grammar_repetition_exceeded' and error['param'] == field
    assert '50000' in error['message'] and '--max-grammar-repetition is 1000' in error['message']


def test_huge_bounds_are_served(api_server, byte_tokens):
    push = {str(byte_tokens[b]): 30.0 for b in (b'\x01', b'\xed', b'\xa0')}
    push[str(byte_tokens[b'"'])] = 40.0
    body = {**CHAT, 'max_tokens': 300, 'response_format': json_schema(HUGE), 'logit_bias': push}
    response = httpx.post(f'{api_server.url}/v1/chat/completions', json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()['choices'][0]
    assert choice['finish_reason'] == 'stop', choice
    jsonschema.validate(json.loads(choice['message']['content']), HUGE)


def enum_format(size: int, tag: str = '') -> dict:
    return json_schema({'enum': [f'{tag}{i}' for i in range(size)]})


def slow_format(tag: str) -> dict:
    """A format whose compile in a worker takes seconds even on a quiet machine (7 s for the tiny model's
    vocabulary; 20,000 values took 0.57 s, no longer than the limits the tests give it)."""
    return enum_format(100_000, tag)


def test_waiting_requests_share_a_compile_and_give_up_a_queued_one(tiny_llama):
    """Requests for a format that is compiling wait for that compile on no worker of their own, so another
    format still gets a worker; a compile not started when all who wait for it gave up never starts."""
    slow = [GenerationConfig(response_format=enum_format(30_000, tag)) for tag in ('first ', 'second ')]
    quick = [GenerationConfig(response_format={'type': 'regex', 'regex': r'\d+'}),
             GenerationConfig(response_format={'type': 'choice', 'choice': ['yes', 'no']})]

    async def main():
        engine = AsyncEngine(tiny_llama, SMALL_CACHE)
        pool, started = engine._grammar_pool, []
        run = pool._run
        pool._run = lambda job, config: started.append(config) or run(job, config)
        try:
            sharing = [asyncio.create_task(engine.compile_grammar(slow[0])) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert await engine.compile_grammar(quick[0], 60) is not None
            assert not any(t.done() for t in sharing), 'the quick format waited for no slow compile'
            other = asyncio.create_task(engine.compile_grammar(slow[1]))
            await asyncio.sleep(0.05)
            with pytest.raises(TimeoutError):  # both workers busy: it waits in the queue, then gives up
                await engine.compile_grammar(quick[1], 0.1)
            grammars = await asyncio.gather(*sharing, other)
            assert grammars[0] is grammars[1] is grammars[2] and started == [slow[0], quick[0], slow[1]]
            assert not engine._compiling
        finally:
            engine.close()
    asyncio.run(main())


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Polls ``condition`` until it holds; fails after ``timeout`` seconds (a loaded machine takes its time to
    end, start and schedule processes, which no fixed pause allows for)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f'not within {timeout} s: {what}'
        await asyncio.sleep(0.02)


def compiling_on_a_worker(engine: AsyncEngine) -> bool:
    """Whether the engine's one compile has reached a worker process."""
    return any(compile.job.worker is not None for compile in engine._compiling.values())


def test_a_compile_over_its_limit_is_killed_and_masks_match_in_process(tiny_llama):
    """A compile every waiter gave up is killed with its process; the next format compiles in a new one, its
    masks those of an in-process compile; a worker the system kills is a 503-class error and is replaced."""
    formats = [enum_format(40, 'v'), {'type': 'regex', 'regex': r'[a-c]{2,4}-\d{3}'},
               json_schema({'type': 'object', 'required': ['a'], 'properties': {
                   'a': {'type': 'array', 'items': {'type': 'integer'}, 'maxItems': 3}, 'b': {'enum': ['x', 'y']}}})]

    async def main():
        engine = AsyncEngine(tiny_llama, SMALL_CACHE)
        pool = engine._grammar_pool
        try:
            start = time.monotonic()
            await engine.compile_grammar(GenerationConfig(response_format={'type': 'regex', 'regex': 'a+'}))
            first = time.monotonic() - start
            before = set(pool.worker_pids())
            slow = asyncio.create_task(engine.compile_grammar(GenerationConfig(response_format=slow_format('a')), 1))
            await wait_until(lambda: compiling_on_a_worker(engine), 'the slow compile reached a worker')
            with pytest.raises(TimeoutError):
                await slow
            assert not engine._compiling
            await wait_until(lambda: len(before ^ set(pool.worker_pids())) == 2,
                             "the given-up compile's worker killed and replaced")
            (killed,), (replacement,) = before - set(pool.worker_pids()), set(pool.worker_pids()) - before
            assert not psutil.pid_exists(killed)
            psutil.Process(replacement).suspend()  # a compile that waited for the replacement would time out
            try:
                start = time.monotonic()
                grammars = [await engine.compile_grammar(GenerationConfig(response_format=formats[0]), 30)]
                next_one = time.monotonic() - start
            finally:
                psutil.Process(replacement).resume()
            grammars += [await engine.compile_grammar(GenerationConfig(response_format=f), 60) for f in formats[1:]]
            print(f'first compile {first:.2f} s (the workers\' start included), the next {next_one:.2f} s')
            local = GrammarCompiler(engine.tokenizer, engine.vocab_size)
            for fmt, grammar in zip(formats, grammars):
                assert_same_masks(grammar, local.compile(GenerationConfig(response_format=fmt)), engine.vocab_size)
            task = asyncio.create_task(engine.compile_grammar(GenerationConfig(response_format=slow_format('w'))))
            await wait_until(lambda: compiling_on_a_worker(engine), 'the second slow compile reached a worker')
            victims = pool.worker_pids()
            for pid in victims:
                psutil.Process(pid).kill()
            with pytest.raises(SafeRunException) as error:
                await task
            assert error.value.code is ErrorCode.ABORTED and 'killed' in error.value.message, error.value
            assert_gone(victims)  # exited (zombies until the pool next looks at them)
            fresh = GenerationConfig(response_format={'type': 'regex', 'regex': 'x+'})  # not cached: a new worker
            assert await engine.compile_grammar(fresh, 60) is not None
            pids = pool.worker_pids()
            assert len(pids) == 2 and not set(victims) & set(pids)
            assert set(pids) <= {child.pid for child in psutil.Process().children()}
        finally:
            engine.close()
    asyncio.run(main())


def test_a_caller_that_gives_up_during_the_start_leaves_it_to_the_others(tiny_llama):
    """The first request for a grammar, dropped by its client while the worker processes started, cancelled
    their shared start: every later compile then failed at once (the server answered 200 with ``null``, or an
    empty stream), until a restart. The soak found it."""
    tokenizer = Tokenizer(tiny_llama)
    pool = GrammarProcessPool(GrammarCompiler(tokenizer, len(tokenizer.hf)), 3)  # its own workers, started here

    async def main():
        first = asyncio.ensure_future(asyncio.wrap_future(pool.start()))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.wait_for(asyncio.wrap_future(pool.start()), 120)

    try:
        asyncio.run(main())
        regex = GenerationConfig(response_format={'type': 'regex', 'regex': 'a{2}'})
        assert pool.submit(regex).future.result(60) is not None
    finally:
        pool.close()


def test_pools_share_their_workers_and_the_last_kills_them(tiny_llama):
    """Two pools of one process, each for its own vocabulary, compile on the same worker process, which is told
    the vocabulary whenever it changes; it outlives the first pool's close and ends with the second's."""
    tokenizer = Tokenizer(tiny_llama)
    sizes = (len(tokenizer.hf), len(tokenizer.hf) + 64)
    pools = [GrammarProcessPool(GrammarCompiler(tokenizer, size), 1) for size in sizes]  # no other pool of size 1
    try:
        for n, pool in enumerate(pools + pools):
            regex = GenerationConfig(response_format={'type': 'regex', 'regex': f'a{{{n + 1}}}'})
            grammar = pool.submit(regex).future.result(60)
            assert grammar.compiled.tokenizer_info.vocab_size == sizes[n % 2]
        pids = pools[0].worker_pids()
        assert len(pids) == 1 and pools[1].worker_pids() == pids
        pools[0].close()
        bad = GenerationConfig(response_format={'type': 'regex', 'regex': 'a('})
        with pytest.raises(ValueError, match='could not be compiled'):  # the worker's answer, not its death
            pools[1].submit(bad).future.result(60)
        assert pools[1].worker_pids() == pids
    finally:
        for pool in pools:
            pool.close()
    assert_gone(pids, timeout=5)


def assert_same_masks(got, want, vocab_size: int) -> None:
    """The two grammars allow the same tokens at each step of a walk that takes the middle allowed token."""
    states = [GrammarState(got), GrammarState(want)]
    masks = [xgr.allocate_token_bitmask(1, vocab_size) for _ in states]
    for _ in range(16):
        if states[0].matcher.is_terminated():
            return
        for state, mask in zip(states, masks):
            state.matcher.fill_next_token_bitmask(mask)
        assert torch.equal(masks[0], masks[1])
        bits = (masks[0][0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist()
        token = allowed[len(allowed) // 2]
        assert [s.matcher.accept_token(token) for s in states] == [True, True]


PARENT = '''
import sys
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.engine.grammar_worker import GrammarProcessPool
from lmdeploy.pytorch.engine.guided import GrammarCompiler
from lmdeploy.tokenizer import Tokenizer

tokenizer = Tokenizer(sys.argv[1])
pool = GrammarProcessPool(GrammarCompiler(tokenizer, len(tokenizer.hf)), 1)
pool.submit(GenerationConfig(response_format={'type': 'regex', 'regex': 'a+'})).future.result()
print(*pool.worker_pids(), flush=True)
sys.stdin.readline()  # the test's signal comes next: until then the worker stays idle
pool.submit(GenerationConfig(response_format={'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {
    'enum': [str(i) for i in range(200_000)]}}}))
print('compiling', flush=True)
sys.stdin.read()
'''


@pytest.mark.parametrize('how', ['SIGTERM', 'SIGKILL'])
def test_no_worker_outlives_its_parent(started, how):
    """Whether the engine's process is terminated or killed, idle or in a compile, its workers end with it."""
    parent = started[how]
    worker = psutil.Process(int(parent.stdout.readline()))
    assert worker.ppid() == parent.pid
    parent.stdin.write('compile\n')
    parent.stdin.flush()
    assert parent.stdout.readline() == 'compiling\n'
    parent.send_signal(getattr(signal, how))
    parent.wait(30)
    worker.wait(10)


SCRIPT_WITHOUT_MAIN_GUARD = '''
import sys
from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
print('top level')
with pipeline(sys.argv[1], PytorchEngineConfig(num_gpu_blocks=64)) as pipe:
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'n', 'schema': {'type': 'integer'}}}
    print(pipe('hi', gen_config=GenerationConfig(max_new_tokens=4, response_format=fmt)).text)
'''


@pytest.fixture(scope='module')
def started(tiny_llama, tmp_path_factory) -> dict[str, subprocess.Popen]:
    """The file's three processes, started side by side (a start is most of each one's test): a parent of a
    grammar worker for each signal, and the script without a main guard."""
    script = tmp_path_factory.mktemp('script') / 'script.py'
    script.write_text(SCRIPT_WITHOUT_MAIN_GUARD)
    processes = {how: subprocess.Popen([sys.executable, '-c', PARENT, tiny_llama], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True) for how in ('SIGTERM', 'SIGKILL')}
    processes['script'] = subprocess.Popen([sys.executable, str(script), tiny_llama], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
    yield processes
    for process in processes.values():
        process.kill()
        process.wait()


def test_a_script_without_a_main_guard_runs_once(started):
    """Spawned grammar workers start from lmdeploy's code alone: a user's script is not run again in them."""
    run = started['script']
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-2000:]
    lines = stdout.splitlines()
    assert lines.count('top level') == 1 and lines[-1].strip().lstrip('-').isdigit(), stdout


def test_a_compile_given_up_just_before_its_loop_closed_logs_nothing(tiny_llama, caplog):
    """The last waiter gives up (a timeout) and its event loop closes before the killed compile's future is
    done: its done callback scheduled on the closed loop, and the pool's thread logged 'exception calling
    callback ... Event loop is closed' (at the end of a server test's fixture, for one)."""
    engine = AsyncEngine(tiny_llama, SMALL_CACHE)

    async def main():
        await engine.compile_grammar(GenerationConfig(response_format={'type': 'json_object'}))  # workers started
        with pytest.raises(TimeoutError):
            await engine.compile_grammar(GenerationConfig(response_format=slow_format('closing')), 0.3)

    try:
        asyncio.run(main())
        time.sleep(1.0)  # the killed compile's future is done on the pool's thread meanwhile
    finally:
        engine.close()
    assert not [r for r in caplog.records if 'exception calling callback' in r.getMessage()]
