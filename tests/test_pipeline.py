"""Pipeline on the tiny Llama: inputs, streaming, chat with prefix caching, threads, loops, close."""
from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import pytest
import torch
from helpers import make_engine, run
from transformers import AutoModelForCausalLM

from lmdeploy import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, client, pipeline, serve
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.vl.processor import MultiModalProcessor

GEN = GenerationConfig(max_new_tokens=8, ignore_eos=True)
FIRST_TURN = 'Hello world! The quick brown fox jumps over the lazy dog.'


def make_pipe(path, **kwargs):
    config = dict(dtype='float32', num_gpu_blocks=64, block_size=16, max_batch_size=8, session_len=256)
    return pipeline(path, backend_config=PytorchEngineConfig(**{**config, **kwargs}), show_progress=False)


@pytest.fixture(scope='module')
def pipe(tiny_llama):
    with make_pipe(tiny_llama) as p:
        yield p


def assert_idle(pipe):
    engine = pipe.async_engine
    assert engine.session_manager.num_active == 0 and engine.inst_manager.num_busy == 0
    assert engine.engine_loop.call(lambda e: len(e.sequences)).result(10) == 0


def test_prompt_kinds_and_per_prompt_configs(pipe, tiny_llama):
    messages = [{'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}, {'type': 'text', 'text': 'there'}]}]
    single = pipe('Hi', gen_config=GEN)
    assert single.finish_reason == 'length' and single.generate_token_len == 8 and single.index == 0
    batch = pipe(['Hi', messages, 'Hi'], gen_config=[GEN, GEN, GenerationConfig(max_new_tokens=3, ignore_eos=True)])
    assert [r.index for r in batch] == [0, 1, 2]
    assert batch[0].token_ids == single.token_ids and batch[2].token_ids == single.token_ids[:3]
    assert pipe(messages, gen_config=GEN).token_ids == batch[1].token_ids
    assert pipe.encode(messages) == pipe.encode('Hi\nthere')
    expected = run(make_engine(tiny_llama), [pipe.encode('Hi'), pipe.encode('raw', do_preprocess=False)], GEN)
    assert single.token_ids == expected[0]
    assert pipe.infer(['raw'], gen_config=GEN, do_preprocess=False, use_tqdm=True)[0].token_ids == expected[1]
    with pytest.raises(ValueError, match='2 gen_configs for 3 prompts'):
        pipe(['a', 'b', 'c'], gen_config=[GEN, GEN])
    with pytest.raises(TypeError):
        pipe(42)
    assert_idle(pipe)


def test_chat_template_override(pipe, tmp_path):
    path = tmp_path / 'template.jinja'
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    processor = MultiModalProcessor(pipe.tokenizer, ChatTemplateConfig(str(path)).chat_template)
    assert processor.render('Hi') == '[user] Hi\n' and processor.render('Hi', do_preprocess=False) == 'Hi'
    with pytest.raises(ValueError, match='chat_template'):
        ChatTemplateConfig('  ')


def test_failed_prompt_fails_alone(pipe):
    long_prompt = 'Paged attention stores keys and values in blocks. ' * 40
    image = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'http://x/cat.png'}}]}]
    good, too_long, no_images = pipe(['Hi', long_prompt, image], gen_config=GEN)
    assert good.token_ids == pipe('Hi', gen_config=GEN).token_ids
    assert too_long.finish_reason == 'error' and 'session_len is 256' in too_long.error
    assert no_images.finish_reason == 'error' and 'does not accept images' in no_images.error
    assert_idle(pipe)


@pytest.mark.parametrize('field, value, match', [
    ('logprobs', True, 'logprobs'), ('logit_bias', {'5x': 1.0}, 'logit_bias'), ('max_new_tokens', 0, 'max_new_tokens'),
    ('stop_token_ids', [10 ** 6], r'stop_token_ids must be in \[0, 320\)')])
def test_a_config_broken_after_it_was_made_fails_its_prompt_alone(pipe, field, value, match):
    """A field set after the config was made was never checked: ``logprobs=True`` or a str key of ``logit_bias``
    failed the engine step, and with it the other prompts batched with it; a stop token out of the vocabulary was
    ignored. The config is checked again when its prompt starts."""
    broken = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    setattr(broken, field, value)
    good, bad = pipe(['Hi', 'Hello'], gen_config=[GEN, broken])
    assert good.finish_reason == 'length' and good.token_ids == pipe('Hi', gen_config=GEN).token_ids
    assert bad.finish_reason == 'error' and re.search(match, bad.error), bad.error
    assert_idle(pipe)


def test_stream_matches_batch_and_early_close_aborts(pipe):
    prompts = ['Hi', 'Hello world!']
    full = pipe(prompts, gen_config=GEN)
    texts, tokens = ['', ''], [[], []]
    for chunk in pipe.stream_infer(prompts, gen_config=GEN):
        texts[chunk.index] += chunk.text
        tokens[chunk.index] += chunk.token_ids
    assert texts == [r.text for r in full] and tokens == [r.token_ids for r in full]
    stream = pipe.stream_infer(prompts, gen_config=GenerationConfig(max_new_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()
    for _ in range(100):
        if pipe.async_engine.session_manager.num_active == 0:
            break
        threading.Event().wait(0.02)
    assert_idle(pipe)


def test_chat_reuses_the_first_turn_kv(pipe, tiny_llama):
    session = pipe.chat(FIRST_TURN, gen_config=GEN)
    first = session.response
    assert pipe.chat('and then?', session=session, gen_config=GEN) is session
    second = session.response
    assert first.cached_tokens == 0 and second.cached_tokens >= 16
    assert [m['role'] for m in session.history] == ['user', 'assistant', 'user', 'assistant']
    assert session.history[1]['content'] == first.text
    with make_pipe(tiny_llama, enable_prefix_caching=False) as uncached:
        other = uncached.chat(FIRST_TURN, gen_config=GEN)
        uncached.chat('and then?', session=other, gen_config=GEN)
        assert other.response.cached_tokens == 0
        assert other.response.token_ids == second.token_ids and other.history == session.history
        assert uncached(['Hi', FIRST_TURN], gen_config=GEN)[1].token_ids == pipe(FIRST_TURN, gen_config=GEN).token_ids
    pipe.end_session(session)
    assert session.session_id not in pipe.async_engine.session_manager.sessions
    with pytest.raises(SafeRunException, match='does not accept images'):
        pipe.chat([{'role': 'user', 'content': [{'type': 'image', 'image': 'x'}]}])
    assert_idle(pipe)


def test_sessions_ids_and_occupied(pipe):
    session = pipe.session(session_id=77, gen_config=GenerationConfig(max_new_tokens=2))
    assert pipe.chat('Hi', session=session).response.generate_token_len <= 2
    with pytest.raises(SafeRunException) as info:
        pipe.session(session_id=77)
    assert info.value.code is ErrorCode.SESSION_OCCUPIED
    pipe.end_session(session)
    with pytest.raises(TypeError, match='str or a list of messages, got NoneType'):  # was: not iterable
        pipe.chat(None)
    with pytest.raises(TypeError, match='session must be a Session'):  # was: no attribute 'session_id'
        pipe.chat('Hi', session=77)
    assert_idle(pipe)
    assert not pipe.async_engine.session_manager.sessions


def test_logits_and_ppl_match_transformers(pipe, tiny_llama):
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    batch = [pipe.encode(FIRST_TURN), pipe.encode('Hi')]
    with torch.no_grad():
        expected = [ref(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item() for ids in batch]
        logits = ref(torch.tensor([batch[0]])).logits[0]
    torch.testing.assert_close(asyncio.run(pipe.async_engine.get_logits(batch[0])), logits, atol=1e-4, rtol=1e-4)
    assert pipe.get_ppl(batch) == pytest.approx(expected, rel=1e-5)
    assert pipe.get_ppl(batch[1]) == pytest.approx(expected[1], rel=1e-5)
    with pytest.raises(SafeRunException, match='at least two'):
        pipe.get_ppl([5])


def test_many_threads_at_once(pipe):
    expected = pipe(['Hi', 'Hello world!'], gen_config=GEN)
    results, errors = {}, []

    def worker(k):
        try:
            results[k] = pipe(['Hi', 'Hello world!'], gen_config=GEN)
            results[-k - 1] = pipe.chat('Hi', gen_config=GEN).response
        except Exception as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 12
    assert all([r.token_ids for r in results[k]] == [r.token_ids for r in expected] for k in range(6))
    assert all(results[-k - 1].token_ids == expected[0].token_ids for k in range(6))


def test_sync_api_inside_a_running_event_loop(pipe):
    """As in Jupyter: the caller's thread runs an asyncio loop and calls the sync API."""
    async def main():
        response = pipe('Hi', gen_config=GEN)
        chunks = list(pipe.stream_infer('Hi', gen_config=GEN))
        return response, chunks
    response, chunks = asyncio.run(main())
    assert [t for c in chunks for t in c.token_ids] == response.token_ids


def test_async_code_drives_the_async_engine(pipe):
    expected = pipe('Hi', gen_config=GEN).token_ids

    async def one():
        return await pipe.async_engine.collect(pipe.async_engine.generate('Hi', gen_config=GEN))

    async def main():
        return await asyncio.gather(*(one() for _ in range(4)), asyncio.to_thread(pipe, 'Hi', gen_config=GEN))
    results = asyncio.run(main())
    assert all(r.token_ids == expected for r in results)
    assert_idle(pipe)


def test_pipelines_share_nothing_and_close(tiny_llama, pipe):
    other = make_pipe(tiny_llama, max_batch_size=2)
    assert other.async_engine.session_manager is not pipe.async_engine.session_manager
    assert other.async_engine.inst_manager is not pipe.async_engine.inst_manager
    mine, theirs = pipe.session(5), other.session(5)
    assert mine is not theirs and mine.session_id == theirs.session_id == 5
    other.chat('Hi', session=theirs, gen_config=GEN)
    assert mine.history == [] and len(theirs.history) == 2
    pipe.end_session(mine)
    threads = (other._thread, other.async_engine.engine_loop._thread)
    other.close()
    other.close()
    assert not any(t.is_alive() for t in threads) and other.async_engine.engine is None
    for call in (lambda: other('Hi'), lambda: other.encode('Hi'), other.session, lambda: other.get_ppl([1, 2])):
        with pytest.raises(RuntimeError, match='closed'):  # encode and session worked on a closed pipeline
            call()


@pytest.mark.parametrize('kwargs, match', [
    ({'model_path': 123}, 'model_path must be a path'),
    ({'backend_config': {'dtype': 'float32'}}, r'got dict; for a dict d, pass PytorchEngineConfig\(\*\*d\)'),
    ({'backend_config': GenerationConfig()}, 'backend_config must be a PytorchEngineConfig'),
    ({'chat_template_config': '{{ messages }}'}, 'chat_template_config must be a ChatTemplateConfig'),
])
def test_pipeline_arguments_of_the_wrong_type(tiny_llama, kwargs, match):
    """A dict of engine settings failed deep in the engine ('dict' object has no attribute 'device'), a str
    template as 'no attribute chat_template'; now a TypeError that says what to pass, before anything loads."""
    with pytest.raises(TypeError, match=match):
        pipeline(**{'model_path': tiny_llama, **kwargs})


def test_serve_is_deprecated():
    with pytest.warns(DeprecationWarning, match='lmdeploy serve api_server'):
        with pytest.raises(NotImplementedError):
            serve('some-model')


def test_api_client_speaks_openai():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers.get('authorization')))
        if request.url.path == '/v1/models':
            return httpx.Response(200, json={'data': [{'id': 'tiny'}]})
        body = json.loads(request.content)
        if body['stream']:
            events = ''.join(f'data: {json.dumps({"n": i})}\n\n' for i in range(3)) + 'data: [DONE]\n\n'
            return httpx.Response(200, text=events, headers={'content-type': 'text/event-stream'})
        return httpx.Response(200, json={'echo': body})
    api = client('http://server:23333/', api_key='secret', transport=httpx.MockTransport(handler))
    assert api.available_models == ['tiny']
    (reply,) = api.chat_completions_v1('tiny', 'Hi', max_tokens=5)
    assert reply['echo']['messages'] == [{'role': 'user', 'content': 'Hi'}] and reply['echo']['max_tokens'] == 5
    assert [e['n'] for e in api.completions_v1('tiny', 'Hi', stream=True)] == [0, 1, 2]
    assert seen[1][:2] == ('POST', '/v1/chat/completions') and seen[2][1] == '/v1/completions'
    assert all(auth == 'Bearer secret' for _, _, auth in seen)
    api.close()
