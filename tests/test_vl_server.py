"""Images through the OpenAI-compatible server: data URLs, allowed domains, local files, bad images."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import openai
import pytest
from security_fixtures import image_host, image_message, qwen_vl  # noqa: F401 (fixtures)
from server_helpers import serve, free_port, tiny_engine, wait_healthy
from test_vl import IMAGES, data_url, png_bytes
from vl_models import hf_vl_greedy

from lmdeploy.vl.media import MediaPolicy
from lmdeploy.vl.processor import ProcessedPrompt


@pytest.fixture(scope='module')
def vl_server(qwen_vl):
    engine = tiny_engine(qwen_vl, media_policy=MediaPolicy(allowed_domains=(), allowed_local_path=None))
    yield from serve(engine, model_name='tiny-vl')


@pytest.fixture
def client(vl_server):
    return openai.OpenAI(base_url=f'{vl_server.url}/v1', api_key='none', max_retries=0)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model='tiny-vl', messages=messages, max_tokens=10, temperature=0,
                                          extra_body={'ignore_eos': True}, **kwargs)


def assert_image_chat_matches_transformers(server, hf_model, hf_inputs, image: bytes) -> ProcessedPrompt:
    """A chat with ``image`` as a data URL, through the official client, answers transformers' 10 greedy tokens
    (``hf_model`` on ``hf_inputs(prompt)``) and counts the prompt's tokens; the processed prompt."""
    messages = image_message(data_url(image))
    prompt = server.engine.processor.process(messages)
    expected = hf_model.generate(**hf_inputs(prompt), max_new_tokens=10, do_sample=False, top_k=None, top_p=None,
                                 temperature=None)[0, len(prompt.input_ids):]
    client = openai.OpenAI(base_url=f'{server.url}/v1', api_key='none', max_retries=0)
    reply = chat(client, messages)
    assert reply.choices[0].message.content == server.engine.tokenizer.decode(expected.tolist())
    assert reply.usage.prompt_tokens == len(prompt.input_ids)
    return prompt


def test_chat_with_image_matches_transformers_and_streams(vl_server, client, qwen_vl):
    messages = image_message(data_url(IMAGES[0]))
    processed = vl_server.engine.processor.process(messages)
    expected = hf_vl_greedy(qwen_vl, processed.input_ids, [m.data for m in processed.multimodal], n=10)
    reply = chat(client, messages)
    assert reply.choices[0].message.content == vl_server.engine.tokenizer.decode(expected)
    assert reply.usage.prompt_tokens == len(processed.input_ids)
    chunks = list(chat(client, messages, stream=True))
    assert ''.join(c.choices[0].delta.content or '' for c in chunks) == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == 'length'


def test_remote_images_only_from_allowed_domains(vl_server, client, image_host):
    host = f'http://127.0.0.1:{image_host[0]}'
    with pytest.raises(openai.BadRequestError, match='allowed-media-domains'):
        chat(client, image_message(f'{host}/cat.png'))
    # the image host is on loopback: it takes allow_private_hosts too (see test_security.py)
    vl_server.engine.processor.media_policy = MediaPolicy(allowed_domains=('127.0.0.1',), allowed_local_path=None,
                                                          allow_private_hosts=True)
    try:
        fetched = chat(client, image_message(f'{host}/cat.png')).choices[0].message.content
        assert fetched == chat(client, image_message(data_url(IMAGES[0]))).choices[0].message.content
        with pytest.raises(openai.BadRequestError, match='did not answer with an image') as error:
            chat(client, image_message(f'{host}/missing.png'))
        assert '404' not in str(error.value)  # the upstream status is not echoed
    finally:
        vl_server.engine.processor.media_policy = MediaPolicy(allowed_domains=(), allowed_local_path=None)


def test_local_files_are_refused_over_http(client, tmp_path):
    path = tmp_path / 'secret.png'
    path.write_bytes(png_bytes(IMAGES[0]))
    for url in (str(path), f'file://{path}'):
        with pytest.raises(openai.BadRequestError, match='local image files are not allowed'):
            chat(client, image_message(url))


def test_bad_images_are_400_and_others_go_on(vl_server, client):
    full = png_bytes(IMAGES[0])
    bad_urls = [data_url(full[:len(full) // 2]), 'data:image/png;base64,!!!', data_url(b'not an image')]
    good = image_message(data_url(IMAGES[1]))
    expected = chat(client, good).choices[0].message.content

    async def run_all():
        async_client = openai.AsyncOpenAI(base_url=f'{vl_server.url}/v1', api_key='none', max_retries=0)
        calls = [async_client.chat.completions.create(model='tiny-vl', messages=m, max_tokens=10, temperature=0,
                                                      extra_body={'ignore_eos': True})
                 for m in [image_message(u) for u in bad_urls] + [good] * 3]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run_all())
    assert all(isinstance(r, openai.BadRequestError) for r in results[:3])
    assert [r.choices[0].message.content for r in results[3:]] == [expected] * 3
    body = httpx.post(f'{vl_server.url}/v1/chat/completions', json={
        'model': 'tiny-vl', 'messages': image_message(bad_urls[0])}).json()
    assert set(body['error']) == {'message', 'type', 'param', 'code'} and body['error']['param'] == 'messages'
    metrics = vl_server.metrics()
    assert metrics['lmdeploy:num_requests_running'] == 0 and metrics['lmdeploy:kv_cache_usage_perc'] == 0


def test_huge_image_is_400(vl_server, client):
    vl_server.engine.processor.media_policy = MediaPolicy(allowed_domains=(), allowed_local_path=None,
                                                          max_image_pixels=1000)
    try:
        with pytest.raises(openai.BadRequestError, match='pixels'):
            chat(client, image_message(data_url(IMAGES[0])))
    finally:
        vl_server.engine.processor.media_policy = MediaPolicy(allowed_domains=(), allowed_local_path=None)


def test_text_only_model_says_it_takes_no_images(api_server):
    body = httpx.post(f'{api_server.url}/v1/chat/completions', json={
        'model': 'tiny', 'messages': image_message(data_url(IMAGES[0]))})
    assert body.status_code == 400 and 'does not accept images' in body.json()['error']['message']


def test_cli_media_flags(qwen_vl, tmp_path, image_host):
    allowed = tmp_path / 'media'
    allowed.mkdir()
    (allowed / 'cat.png').write_bytes(png_bytes(IMAGES[0]))
    port, host = free_port(), f'http://127.0.0.1:{image_host[0]}'
    proc = subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', 'serve', 'api_server', qwen_vl,
                             '--server-port', str(port), '--dtype', 'float32', '--num-gpu-blocks', '64',
                             '--model-name', 'tiny-vl', '--allowed-local-media-path', str(allowed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f'http://127.0.0.1:{port}'
        wait_healthy(url, proc)
        request = {'model': 'tiny-vl', 'messages': image_message(str(allowed / 'cat.png')), 'max_tokens': 4}
        accepted = httpx.post(f'{url}/v1/chat/completions', json=request, timeout=60)
        assert accepted.status_code == 200, accepted.text
        request['messages'] = image_message(f'{host}/cat.png')
        refused = httpx.post(f'{url}/v1/chat/completions', json=request, timeout=60)
        assert refused.status_code == 400 and 'not allowed' in refused.json()['error']['message']
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert os.path.exists(allowed / 'cat.png')
