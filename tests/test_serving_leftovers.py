"""Serving leftovers (the hunt of 2026-12-07): a prompt with images refused for its length before its images are
preprocessed; reasoning with ``response_format`` and forced tool calls; the text around a Mistral or DeepSeek
marker that starts no call; Hermes tags that are special tokens. Each through a real server on a tiny model,
streamed and not, every KV block free afterwards. docs/reliability.md ("Serving leftovers") has the hunt."""
from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import jsonschema
import pytest
from PIL import ExifTags, Image
from helpers import assert_all_released
from security_fixtures import qwen_vl  # noqa: F401 (fixture)
from server_helpers import ServerThread, serve, serve_per_parser, tiny_engine
from test_llama4_vl import save_tiny_llama4_vl
from test_tool_server_hunt import ask, assert_released, regex
from test_vl import data_url, png_bytes
from tool_models import save_tool_model
from transformers import AutoConfig
from vl_models import VL_KINDS, save_tiny_vl_model

from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.tokenizer import Tokenizer
from lmdeploy.vl.image_inputs import ImageInputs
from lmdeploy.vl.media import MediaPolicy
from lmdeploy.vl.processor import MultiModalProcessor, PromptTooLong

SESSION_LEN = 256
CITY = {'type': 'object', 'required': ['city'], 'additionalProperties': False,
        'properties': {'city': {'type': 'string', 'enum': ['Paris', 'Rome']}}}
WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'parameters': CITY}}
ANSWER = {'type': 'object', 'required': ['answer'], 'additionalProperties': False,
          'properties': {'answer': {'type': 'integer', 'minimum': 0, 'maximum': 99}}}
ASK = [{'role': 'user', 'content': 'Weather in Paris?'}]


def image_parts(*sizes: tuple[int, int]) -> list[dict]:
    return [{'type': 'image_url', 'image_url': {'url': data_url(Image.new('RGB', size, (90, 30, 60)))}}
            for size in sizes]


@pytest.fixture(scope='module')
def vl_server(qwen_vl):
    yield from serve(tiny_engine(qwen_vl, session_len=SESSION_LEN), model_name='tiny-vl')


@pytest.fixture
def preprocessed(vl_server):
    """The sizes of the images preprocessed while the test runs."""
    inputs = vl_server.engine.processor.image_inputs
    original, done = type(inputs), []

    def counted_call(self, image):
        done.append(image.size)
        return original.__call__(self, image)
    inputs.__class__ = type(original.__name__, (original, ), {'__call__': counted_call})
    yield done
    inputs.__class__ = original


@pytest.mark.parametrize('text, sizes', [('word ' * 400, [(64, 64)] * 16), ('describe', [(128, 128)] * 16)],
                         ids=['by its text', 'by its images'])
def test_a_prompt_too_long_is_refused_before_its_images_are_preprocessed(vl_server, preprocessed, text, sizes):
    """Was: all 16 images loaded and preprocessed (4.9 s for 16 of 2048x2048 at load 10), then the 400. Now the
    text's tokens, or with them the token counts of the images' headers (Qwen2-VL's resize), refuse it first."""
    messages = [{'role': 'user', 'content': image_parts(*sizes) + [{'type': 'text', 'text': text}]}]
    r = httpx.post(f'{vl_server.url}/v1/chat/completions', timeout=60,
                   json={'model': 'tiny-vl', 'messages': messages, 'max_tokens': 2})
    assert r.status_code == 400 and r.json()['error']['code'] == 'context_length_exceeded', r.text
    assert preprocessed == []
    assert_all_released(vl_server.engine)
    with pytest.raises(SafeRunException) as refused:  # pipeline() and the chat CLI go this way
        asyncio.run(vl_server.engine.process(messages))
    assert refused.value.code is ErrorCode.INPUT_LENGTH_ERROR and preprocessed == []
    served = httpx.post(f'{vl_server.url}/v1/chat/completions', timeout=60, json={
        'model': 'tiny-vl', 'messages': [{'role': 'user', 'content': image_parts(*sizes[:2])}], 'max_tokens': 2})
    assert served.status_code == 200, served.text
    assert_released(vl_server.engine)


def rotated_jpeg(size: tuple[int, int]) -> str:
    """A data URL of a JPEG of ``size`` whose EXIF orientation (6) turns it a quarter: upright it is ``size``
    swapped."""
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    buffer = io.BytesIO()
    Image.new('RGB', size, (90, 30, 60)).save(buffer, format='JPEG', exif=exif)
    return 'data:image/jpeg;base64,' + base64.b64encode(buffer.getvalue()).decode()


HEADER_SIZES = {'tiny': (1, 1), 'wide': (1000, 29), 'tall': (29, 1000), 'huge': (2048, 2048),
                'portrait': (300, 1000)}


@pytest.mark.parametrize('kind', [*VL_KINDS, 'gemma3', 'qwen3_5', 'llama4'])
def test_the_token_count_from_the_header_is_the_preprocessed_one(kind, tmp_path):
    """Every family's count from an image's header is the count its preprocessing gives (was: one token an image
    for InternVL's tiles, Mistral 3's rows and Llama 4's tiles), a JPEG turned by its EXIF orientation too."""
    path = save_tiny_llama4_vl(str(tmp_path)) if kind == 'llama4' else save_tiny_vl_model(kind, str(tmp_path))
    tokenizer = Tokenizer(path)
    processor = MultiModalProcessor(tokenizer, image_inputs=ImageInputs.for_model(
        path, AutoConfig.from_pretrained(path), tokenizer.hf))
    urls = {name: data_url(Image.new('RGB', size, (90, 30, 60))) for name, size in HEADER_SIZES.items()}
    urls['turned'] = rotated_jpeg((1000, 300))
    for name, url in urls.items():
        prompt = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': url}}] * 2
                   + [{'type': 'text', 'text': 'compare'}]}]
        with pytest.raises(PromptTooLong) as refused:
            processor.process(prompt, token_limit=1)
        assert refused.value.tokens == len(processor.process(prompt).input_ids), name


def test_images_without_a_size_in_their_source_stop_at_the_one_that_reaches_the_limit(vl_server, preprocessed,
                                                                                    tmp_path):
    """An image read from a file (or fetched from a URL) is counted once preprocessed: the images after the one
    that makes the prompt too long are not loaded."""
    engine = vl_server.engine
    (tmp_path / 'big.png').write_bytes(png_bytes(Image.new('RGB', (128, 128))))  # 16 tokens, as 2048x2048
    processor = MultiModalProcessor(engine.tokenizer, image_inputs=engine.processor.image_inputs,
                                    media_policy=MediaPolicy(allowed_local_path=str(tmp_path)))

    def prompt(images: int) -> list[dict]:
        return [{'role': 'user', 'content': [{'type': 'image', 'image': str(tmp_path / 'big.png')}] * images}]
    one, two = (processor.process(prompt(n)) for n in (1, 2))
    per_image, image_tokens = len(two.input_ids) - len(one.input_ids), one.multimodal[0].length
    whole = len(one.input_ids) + 15 * per_image
    least = [whole - (16 - k) * (image_tokens - 1) for k in range(17)]  # k images preprocessed, the others 1 token
    expected = next(k for k, tokens in enumerate(least) if tokens >= SESSION_LEN)
    assert 0 < expected < 16
    preprocessed.clear()
    with pytest.raises(PromptTooLong):
        processor.process(prompt(16), token_limit=SESSION_LEN)
    assert len(preprocessed) == expected


@pytest.fixture(scope='module')
def servers(tmp_path_factory):
    """A server for a tool parser's name, with ``qwen3`` reasoning, all on one engine: the tiny model of
    ``tests/tool_models.py`` with ``<tool_call>`` and ``</tool_call>`` made special tokens."""
    path = save_tool_model(str(tmp_path_factory.mktemp('special_markers')), special=('<tool_call>', '</tool_call>'))
    engine = tiny_engine(path)
    yield from serve_per_parser(engine, reasoning_parser='qwen3')


def bias(server: ServerThread, token: str, value: float) -> dict[str, float]:
    ids = server.engine.tokenizer.encode(token, add_special_tokens=False)
    assert len(ids) == 1
    return {str(ids[0]): value}


def gathered(url: str, body: dict) -> dict:
    """Choice 0's message as a client gathers it from the stream (calls by ``index``)."""
    out = {'reasoning': '', 'content': '', 'calls': {}, 'finish_reason': None}
    with httpx.stream('POST', f'{url}/v1/chat/completions', json={**body, 'stream': True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith('data: ') and line != 'data: [DONE]':
                for choice in json.loads(line[6:])['choices']:
                    delta = choice['delta']
                    out['reasoning'] += delta.get('reasoning_content') or ''
                    out['content'] += delta.get('content') or ''
                    out['finish_reason'] = choice['finish_reason'] or out['finish_reason']
                    for piece in delta.get('tool_calls') or []:
                        call = out['calls'].setdefault(piece['index'], ['', ''])
                        call[0] += piece['function'].get('name') or ''
                        call[1] += piece['function']['arguments']
    out['calls'] = [tuple(call) for _, call in sorted(out['calls'].items())]
    return out


def reason_then(server: ServerThread, **body) -> dict:
    """A reply that reasons a few tokens (the prompt opens the block; a small bias closes it), then answers as
    ``body`` asks; the non-streamed message, checked to be what the stream gathers to, every block free after."""
    body = {'model': 'm', 'messages': ASK, 'tools': [WEATHER], 'max_tokens': 200, 'temperature': 1.0, 'seed': 3,
            'logit_bias': bias(server, '</think>', 6), 'chat_template_kwargs': {'open_think': True}, **body}
    r = httpx.post(f'{server.url}/v1/chat/completions', json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()['choices'][0]
    message = {'reasoning': choice['message']['reasoning_content'] or '', 'content': choice['message']['content'] or '',
               'calls': [(c['function']['name'], c['function']['arguments'])
                         for c in choice['message']['tool_calls'] or []],
               'finish_reason': choice['finish_reason']}
    assert_all_released(server.engine)
    assert gathered(server.url, body) == message
    assert_released(server.engine)
    assert message['reasoning']
    return message


def test_response_format_with_reasoning_and_tools_auto_answers_in_the_format(servers):
    """The format applies after the reasoning; it leaves no room for a call, so the content is the JSON."""
    message = reason_then(servers('hermes'), response_format={
        'type': 'json_schema', 'json_schema': {'name': 'answer', 'schema': ANSWER, 'strict': True}})
    assert message['calls'] == [] and message['finish_reason'] == 'stop'
    jsonschema.validate(json.loads(message['content']), ANSWER)


@pytest.mark.parametrize('tool_choice', ['required', {'type': 'function', 'function': {'name': 'get_weather'}}])
def test_a_forced_call_after_reasoning(servers, tool_choice):
    """The reasoning, then the calls, no content; streamed the same."""
    message = reason_then(servers('hermes'), tool_choice=tool_choice, parallel_tool_calls=False)
    (name, arguments), = message['calls']
    assert name == 'get_weather' and message['content'] == '' and message['finish_reason'] == 'tool_calls'
    jsonschema.validate(json.loads(arguments), CITY)


@pytest.mark.parametrize('parser, reply, content', [
    ('mistral', 'Hi. [TOOL_CALLS]not a call', 'Hi. [TOOL_CALLS]not a call'),
    ('mistral', 'Hi.\n[TOOL_CALLS][{"x": 1}]', 'Hi.\n[TOOL_CALLS][{"x": 1}]'),
    ('deepseek_v3', 'Hi.\n<｜tool▁calls▁begin｜> not a call', 'Hi.\n<｜tool▁calls▁begin｜> not a call')])
def test_a_marker_that_starts_no_call_leaves_the_text_as_written(servers, parser, reply, content):
    """Was: the whitespace before the marker went with it (``Hi.not a call``), and with Mistral's list the
    ``[`` too. The marker is no token of this tokenizer, so it stays, as in the text without a parser (a special
    marker is left out: ``tests/test_serving_leftovers2.py``)."""
    message = ask(servers(parser), {'structured_outputs': {'regex': regex(reply)},
                                    'chat_template_kwargs': {'enable_thinking': False}})
    assert message == {'content': content, 'calls': [], 'finish_reason': 'stop'}


def test_hermes_tags_that_are_special_tokens_still_make_calls(servers):
    """``<tool_call>`` as a special token (the bias makes the model write it as one) was dropped by the
    detokenizer: the call came back as content, ``Hi.\\n\\n{"name": ...}``."""
    server = servers('hermes')
    assert server.engine.tokenizer.decode(server.engine.tokenizer.encode('<tool_call>', add_special_tokens=False)) == ''
    call = '{"city": "Paris"}'
    reply = f'Hi.\n<tool_call>\n{{"name": "get_weather", "arguments": {call}}}\n</tool_call>'
    special = {**bias(server, '<tool_call>', 100), **bias(server, '</tool_call>', 100)}
    body = {'structured_outputs': {'regex': regex(reply)}, 'logit_bias': special, 'logprobs': True,
            'chat_template_kwargs': {'enable_thinking': False}}
    assert ask(server, body) == {'content': 'Hi.', 'calls': [('get_weather', call)], 'finish_reason': 'tool_calls'}
    r = httpx.post(f'{server.url}/v1/chat/completions', timeout=120, json={
        'model': 'm', 'messages': ASK, 'tools': [WEATHER], 'temperature': 0, 'max_tokens': 300, **body})
    assert [t['token'] for t in r.json()['choices'][0]['logprobs']['content']].count('<tool_call>') == 1
    assert_released(server.engine)
