"""Hostile images through a real server on a tiny random Qwen2-VL (and the image loader under it): each attack that
once cost minutes of preprocessing, gave a wrong answer or kept a preprocessing thread busy for a client that had
gone, as it is answered now. docs/reliability.md ("Images") has the whole hunt."""
from __future__ import annotations

import asyncio
import io
import threading
import time

import httpx
import pytest
from PIL import Image
from security_fixtures import image_message, qwen_vl  # noqa: F401 (fixtures)
from server_helpers import serve, tiny_engine
from test_vl import IMAGES, data_url, png_bytes

from lmdeploy.vl.media import MediaPolicy, load_image

ORIENTATION = 0x0112


@pytest.fixture(scope='module')
def vl_server(qwen_vl):
    # one preprocessing thread: what keeps it busy delays every other request
    yield from serve(tiny_engine(qwen_vl), model_name='tiny-vl', preprocess_workers=1)


@pytest.fixture
def slow_images(vl_server):
    """Each image's preprocessing takes 0.1 s longer; yields the list of the images preprocessed so far."""
    inputs = vl_server.engine.processor.image_inputs
    original, done = type(inputs), []

    def slow_call(self, image):
        time.sleep(0.1)
        done.append(image.size)
        return original.__call__(self, image)
    inputs.__class__ = type(original.__name__, (original, ), {'__call__': slow_call})
    yield done
    inputs.__class__ = original


@pytest.mark.parametrize('size', [(1, 16000), (16000, 1), (28, 5700)])
def test_extreme_aspect_ratios_are_refused_from_the_header(size):
    """A 1x16000 PNG (a few hundred bytes) once took 20 s of a preprocessing thread on LLaVA, whose processor
    resizes the shortest side to its crop size first (to 56x896,000 pixels for the tiny model; 336x5,376,000
    for LLaVA 1.5); a longest side over 200 times the shortest (Qwen2-VL's own bound) is refused."""
    with pytest.raises(ValueError, match='more than 200 times its shortest'):
        load_image(png_bytes(Image.new('RGB', size)), MediaPolicy())
    assert load_image(png_bytes(Image.new('RGB', (2, 400))), MediaPolicy()).size == (2, 400)


@pytest.mark.parametrize('size', [(0, 0), (0, 100), (100, 0)])
def test_an_image_without_pixels_is_refused(size):
    """An empty PIL image (``pipeline()`` takes them) went on to the image processor, whose ZeroDivisionError
    (Qwen-VL, LLaVA, InternVL) was not the ValueError that bad input gives."""
    with pytest.raises(ValueError, match='it has none'):
        load_image(Image.new('RGB', size), MediaPolicy())


@pytest.mark.parametrize('fmt', ['JPEG', 'PNG'])
def test_exif_orientation_turns_the_image_upright(fmt):
    """A photo whose EXIF says "rotated 90 degrees" reached the model on its side (transformers' ``load_image``
    turns it upright); a PIL image with that EXIF, as ``pipeline()`` takes it, too."""
    upright = IMAGES[0].transpose(Image.Transpose.ROTATE_270)
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    buffer = io.BytesIO()
    IMAGES[0].save(buffer, format=fmt, exif=exif, quality=100)
    loaded = load_image(buffer.getvalue(), MediaPolicy())
    assert loaded.size == upright.size
    if fmt == 'PNG':
        assert loaded.tobytes() == upright.tobytes()
    assert load_image(Image.open(io.BytesIO(buffer.getvalue())), MediaPolicy()).size == upright.size


def test_generate_with_an_image_sees_the_image(vl_server):
    """``/generate`` with messages holding an image once tokenized them (the image's placeholder tokens
    included) but ran them without the image: the answer of a model that never saw it. It answers as the chat
    endpoint does now."""
    messages = image_message(data_url(IMAGES[0]))
    fields = {'max_tokens': 8, 'temperature': 0, 'ignore_eos': True}
    chat = httpx.post(f'{vl_server.url}/v1/chat/completions', json={'model': 'tiny-vl', 'messages': messages, **fields},
                      timeout=60)
    generated = httpx.post(f'{vl_server.url}/generate', json={'prompt': messages, **fields}, timeout=60)
    assert chat.status_code == generated.status_code == 200, (chat.text, generated.text)
    assert generated.json()['text'] == chat.json()['choices'][0]['message']['content']
    assert generated.json()['input_tokens'] == chat.json()['usage']['prompt_tokens']


@pytest.mark.parametrize('path', ['/v1/chat/completions', '/generate'])
def test_a_client_that_leaves_stops_the_preprocessing_of_its_images(vl_server, slow_images, path):
    """16 images whose client hung up during the first: the preprocessing thread went on with the other 15 (16
    images of 4096x4096 took it 48 s at load 15, and a request after two such took 86 s). It stops before the
    next image now."""
    images = [{'type': 'image_url', 'image_url': {'url': data_url(IMAGES[0])}}] * 16
    messages = [{'role': 'user', 'content': images}]
    body = {'model': 'tiny-vl', 'messages': messages} if path != '/generate' else {'prompt': messages}

    async def main():
        async with httpx.AsyncClient(base_url=vl_server.url, timeout=60) as http:
            leaving = asyncio.create_task(http.post(path, json={**body, 'max_tokens': 2}))
            while not slow_images:
                assert not leaving.done(), (await leaving).text
                await asyncio.sleep(0.01)
            leaving.cancel()
            served = await http.post('/v1/chat/completions', json={
                'model': 'tiny-vl', 'messages': image_message(data_url(IMAGES[1])), 'max_tokens': 2})
            return served, len(slow_images)

    served, preprocessed = asyncio.run(main())
    assert served.status_code == 200, served.text
    assert preprocessed <= 3, f'{preprocessed - 1} images were preprocessed for a client that had gone'
    state = vl_server.app.state.server
    assert state.admission.running == 0 and not vl_server.engine.session_manager.sessions


def test_a_client_that_leaves_while_its_encode_request_is_tokenized_frees_its_slot_at_once(vl_server):
    """``/v1/encode`` raced only its wait for admission against its client's hang-up: a client that left while
    its texts were tokenized held its slot until the tokenizer finished. Its slot comes back at once now."""
    state, processor = vl_server.app.state.server, vl_server.engine.processor
    tokenizing, release = threading.Event(), threading.Event()

    def slow_encode(prompt, do_preprocess=True):
        tokenizing.set()
        release.wait(10)
        return type(processor).encode(processor, prompt, do_preprocess)

    async def main():
        async with httpx.AsyncClient(base_url=vl_server.url, timeout=60) as http:
            leaving = asyncio.create_task(http.post('/v1/encode', json={'input': 'hello', 'do_preprocess': True}))
            while not tokenizing.is_set():
                assert not leaving.done(), (await leaving).text
                await asyncio.sleep(0.01)
            leaving.cancel()
            left = time.monotonic()
            while state.admission.running and time.monotonic() - left < 2:
                await asyncio.sleep(0.02)
            return time.monotonic() - left

    processor.encode = slow_encode
    try:
        seconds = asyncio.run(main())
    finally:
        release.set()
        del processor.encode
    assert seconds < 1, f'the slot was held {seconds:.2f} s after the client left'
