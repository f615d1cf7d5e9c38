"""The OpenAI-compatible server end to end, driven by the official ``openai`` client."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from server_helpers import ServerThread, free_port, tiny_engine, wait_healthy

from transformers import AutoModelForCausalLM

from lmdeploy.serve.openai.api_server import create_app

NO_EOS = {'ignore_eos': True}
MESSAGES = [{'role': 'user', 'content': 'Hello world!'}]


@pytest.fixture(scope='module')
def client(api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{api_server.url}/v1', api_key='none', max_retries=0)


def test_models_and_docs(api_server, client):
    assert [m.id for m in client.models.list().data] == ['tiny']
    assert httpx.get(f'{api_server.url}/openapi.json').json()['paths'].keys() >= {
        '/v1/chat/completions', '/v1/completions', '/generate', '/v1/encode', '/abort_request', '/health', '/metrics'}
    assert httpx.get(f'{api_server.url}/docs').status_code == 200


def test_chat_greedy_matches_engine_and_stream(api_server, client):
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=12, temperature=0, extra_body=NO_EOS)
    ids = api_server.engine.encode(MESSAGES)
    assert r.choices[0].finish_reason == 'length' and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    native = httpx.post(f'{api_server.url}/generate', json={'input_ids': ids, 'max_tokens': 12, 'ignore_eos': True})
    assert native.json()['text'] == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=12, temperature=0,
                                                 extra_body=NO_EOS, stream=True,
                                                 stream_options={'include_usage': True}, user='u1'))
    assert chunks[0].choices[0].delta.role == 'assistant'
    assert ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices) == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == 'length'
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_chat_n_logprobs_seed(client):
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=6, n=2, seed=3, temperature=1.0,
                                       logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)
    again = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=6, n=2, seed=3,
                                           temperature=1.0, extra_body=NO_EOS)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_completions(client):
    r = client.completions.create(model='tiny', prompt=['Hello world', 'The quick'], max_tokens=5, temperature=0,
                                  n=2, logprobs=2, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and all(c.finish_reason == 'length' for c in r.choices)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and lp.text_offset[0] == 0
    echo = client.completions.create(model='tiny', prompt='Hello world', max_tokens=5, temperature=0, echo=True,
                                     extra_body=NO_EOS)
    assert echo.choices[0].text == 'Hello world' + r.choices[0].text
    stream = list(client.completions.create(model='tiny', prompt='Hello world', max_tokens=5, temperature=0,
                                            stream=True, extra_body=NO_EOS))
    assert ''.join(c.choices[0].text for c in stream) == r.choices[0].text
    ids = client.completions.create(model='tiny', prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body=NO_EOS)
    assert ids.usage.prompt_tokens == 3


def test_completions_echo_logprobs(api_server, client, tiny_llama):
    prompt = 'Hello world! The quick'
    ids = api_server.engine.encode(prompt, do_preprocess=False)
    kwargs = dict(model='tiny', prompt=prompt, max_tokens=4, temperature=0, logprobs=2, extra_body=NO_EOS)
    plain = client.completions.create(**kwargs).choices[0].logprobs
    choice = client.completions.create(echo=True, **kwargs).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[len(ids):] == plain.tokens and lp.text_offset[len(ids)] == len(prompt)
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.token_logprobs, abs=1e-4)
    assert all(choice.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    expected = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(ids)]), expected, atol=1e-4)
    for top, row in zip(lp.top_logprobs[1:len(ids)], ref):  # tokens with the same text share a key
        best = row.topk(2).values.tolist()
        assert 1 <= len(top) <= 2 and all(min(abs(v - b) for b in best) < 1e-4 for v in top.values())
    chunks = list(client.completions.create(echo=True, stream=True, **kwargs))
    assert ''.join(c.choices[0].text for c in chunks) == choice.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset



def test_stream_events_stay_one_line_each(api_server):
    """Text with U+0085, U+2028 and U+2029 (line breaks to str.splitlines, raw in JSON) is escaped in events,
    so that a client reading lines with httpx's aiter_lines gets every event whole."""
    prompt = 'one\x85two\u2028three\u2029four'
    body = {'model': 'tiny', 'prompt': prompt, 'echo': True, 'max_tokens': 2, 'stream': True}
    with httpx.stream('POST', f'{api_server.url}/v1/completions', json=body, timeout=60) as resp:
        events = [line[len('data: '):] for line in resp.iter_lines() if line]
    assert events[-1] == '[DONE]'
    text = ''.join(choice['text'] for event in events[:-1] for choice in json.loads(event)['choices'])
    assert text.startswith(api_server.engine.tokenizer.decode(api_server.engine.encode(prompt, False)))
    assert '\u2028' in text

def test_stop_and_penalties(client):
    base = client.completions.create(model='tiny', prompt='Hello world', max_tokens=16, temperature=0,
                                     extra_body=NO_EOS).choices[0].text
    word = base.strip()[2:4] if len(base.strip()) > 4 else base.strip()[:1]
    stopped = client.completions.create(model='tiny', prompt='Hello world', max_tokens=16, temperature=0,
                                        extra_body=NO_EOS, stop=[word]).choices[0]
    assert stopped.finish_reason == 'stop' and word not in stopped.text and base.startswith(stopped.text)
    penalised = client.completions.create(model='tiny', prompt='Hello world', max_tokens=16, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={'ignore_eos': True, 'repetition_penalty': 1.5, 'min_p': 0.01, 'top_k': 5})
    assert penalised.choices[0].text != base
    biased = client.completions.create(model='tiny', prompt='Hello world', max_tokens=4, temperature=0,
                                       extra_body=NO_EOS, logit_bias={'100': 100}, logprobs=0)
    assert biased.choices[0].logprobs.tokens == [biased.choices[0].logprobs.tokens[0]] * 4
    by_id = client.completions.create(model='tiny', prompt='Hello world', max_tokens=8, temperature=0,
                                      extra_body={'stop_token_ids': [100], 'min_tokens': 2}, logit_bias={'100': 100})
    assert by_id.choices[0].finish_reason == 'stop' and by_id.usage.completion_tokens == 3


def test_encode_generate_abort(api_server):
    url = api_server.url
    enc = httpx.post(f'{url}/v1/encode', json={'input': 'Hello world'}).json()
    assert enc['length'] == len(enc['input_ids']) > 0
    with httpx.stream('POST', f'{url}/generate', json={'input_ids': enc['input_ids'], 'session_id': 777,
                                                       'max_tokens': 5000, 'ignore_eos': True, 'stream': True},
                      timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith('data:'))
        assert httpx.post(f'{url}/abort_request', json={'session_id': 777}).json() == {'success': True}
        events = [line for line in lines if line.startswith('data:')]
    assert '"finish_reason": "abort"' in events[-2] and events[-1] == 'data: [DONE]'
    # abort_all is an admin action, refused without --admin-api-keys (tests/test_security.py covers it)
    assert httpx.post(f'{url}/abort_request', json={'abort_all': True}).status_code == 403


def test_metrics(api_server, client):
    client.completions.create(model='tiny', prompt='Hello world', max_tokens=4, temperature=0, extra_body=NO_EOS)
    m = api_server.metrics()
    assert m['lmdeploy:num_requests_running'] == 0 and m['lmdeploy:num_requests_waiting'] == 0
    assert 0 <= m['lmdeploy:kv_cache_usage_perc'] <= 1 and 0 <= m['lmdeploy:prefix_cache_hit_rate'] <= 1
    assert m['lmdeploy:request_success_total{finish_reason="length"}'] >= 1
    assert m['lmdeploy:prompt_tokens_total'] > 0 and m['lmdeploy:generation_tokens_total'] >= 4
    assert m['lmdeploy:time_to_first_token_seconds_count'] >= 1
    assert m['lmdeploy:time_per_output_token_seconds_count'] >= 1


def test_health_503_when_engine_loop_dies(tiny_llama):
    engine = tiny_engine(tiny_llama, num_gpu_blocks=32)
    server = ServerThread(create_app(engine, model_name='tiny'))
    try:
        assert httpx.get(f'{server.url}/health').status_code == 200

        def die():
            raise SystemExit('engine killed by the test')
        engine.engine.step = die
        r = httpx.post(f'{server.url}/generate', json={'prompt': 'hi', 'max_tokens': 4}, timeout=30)
        assert r.status_code == 500
        health = httpx.get(f'{server.url}/health')
        assert health.status_code == 503 and 'engine killed' in health.json()['error']['message']
    finally:
        server.stop()
        engine.close()


def test_sigterm_graceful_shutdown(tiny_llama):
    """SIGTERM mid-stream: the stream ends in full and the server exits 0. (The 200 tokens take ~2 s alone and
    over 20 s on 2 cores shared with 7 busy processes: the drain's limit is far above either.)"""
    port = free_port()
    proc = subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', 'serve', 'api_server', tiny_llama,
                             '--dtype', 'float32', '--num-gpu-blocks', '64', '--block-size', '16',
                             '--server-port', str(port), '--model-name', 'tiny', '--shutdown-timeout', '120'],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
    url = f'http://127.0.0.1:{port}'
    try:
        wait_healthy(url, proc)
        with httpx.stream('POST', f'{url}/v1/completions', json={'model': 'tiny', 'prompt': 'Hello', 'max_tokens': 200,
                                                                 'ignore_eos': True, 'stream': True,
                                                                 'temperature': 0}, timeout=30) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith('data:'))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith('data:')]
        assert rest[-1] == 'data: [DONE]' and '"finish_reason":"length"' in rest[-2].replace(' ', '')
        assert proc.wait(timeout=30) == 0
        # at the default log level (INFO) it says what it serves, each request, and how the shutdown goes
        log = proc.stdout.read().decode()
        assert f'serving tiny on http://127.0.0.1:{port} (chat page at /)' in log, log
        model = next(line for line in log.splitlines() if line.startswith('INFO:  model '))
        assert f'{tiny_llama}: float32 on cpu, KV cache 1024 tokens (64 blocks of 16)' in model, model
        assert model.endswith('native CPU kernels') or model.endswith('torch CPU kernels'), model
        assert '"POST /v1/completions HTTP/1.1" 200' in log and '"GET /health HTTP/1.1" 200' in log, log
        # (the stream may finish before the server gets to its shutdown: 0 or 1 in flight)
        assert re.search(r'shutting down: [01] requests in flight get up to 120 s to finish', log), log
        assert 'INFO:  stopped' in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sampling_defaults_come_from_the_generation_config(tiny_llama, tmp_path):
    """Fields a request leaves out take the model's generation_config.json values ('auto', the default);
    with 'none' they are the OpenAI API's (temperature 1, top_p 1)."""
    import shutil
    model = shutil.copytree(tiny_llama, tmp_path / 'model')
    path = model / 'generation_config.json'
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, 'temperature': 0.0, 'top_p': 0.5, 'top_k': 7}))
    engine = tiny_engine(str(model))
    body = {'model': 'tiny', 'messages': MESSAGES, 'max_tokens': 16, 'ignore_eos': True, 'seed': 3}

    def reply(server: ServerThread, **fields) -> str:
        r = httpx.post(f'{server.url}/v1/chat/completions', json={**body, **fields}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()['choices'][0]['message']['content']

    try:
        auto = ServerThread(create_app(engine, model_name='tiny'))
        try:
            assert auto.app.state.server.sampling_defaults == {'temperature': 0.0, 'top_p': 0.5, 'top_k': 7}
            greedy, unset = reply(auto, temperature=0), reply(auto)
            sampled = reply(auto, temperature=1.0, top_p=1.0, top_k=0)
        finally:
            auto.stop()
        assert unset == greedy and sampled != greedy
        plain = ServerThread(create_app(engine, model_name='tiny', generation_config='none'))
        try:
            assert reply(plain) == sampled
        finally:
            plain.stop()
    finally:
        engine.close()
