"""Vision-language models through the engine and the pipeline, against transformers."""
from __future__ import annotations

import base64
import io
import subprocess
import sys

import pytest
from vl_models import VL_KINDS, hf_vl_greedy, random_image, save_tiny_vl_model

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy.serve.exceptions import SafeRunException

GREEDY = GenerationConfig(max_new_tokens=12, ignore_eos=True)
IMAGES = [random_image(1), random_image(2, (60, 60))]


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format='PNG')
    return buffer.getvalue()


def data_url(image_or_bytes) -> str:
    data = image_or_bytes if isinstance(image_or_bytes, bytes) else png_bytes(image_or_bytes)
    return 'data:image/png;base64,' + base64.b64encode(data).decode()


@pytest.fixture(scope='module', params=VL_KINDS)
def vl_model(request, tmp_path_factory) -> str:
    return save_tiny_vl_model(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def vl_pipe(vl_model):
    pipe = pipeline(vl_model, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    yield pipe
    pipe.close()


def reference(pipe, path: str, prompt) -> list[int]:
    processed = pipe.async_engine.processor.process(prompt)
    return hf_vl_greedy(path, processed.input_ids, [m.data for m in processed.multimodal], n=GREEDY.max_new_tokens)


@pytest.mark.parametrize('num_images', [1, 2])
def test_greedy_matches_transformers(vl_pipe, vl_model, num_images):
    prompt = ('describe', IMAGES[:num_images])
    out = vl_pipe(prompt, gen_config=GREEDY)
    assert out.finish_reason == 'length'
    assert out.token_ids == reference(vl_pipe, vl_model, prompt)


def test_batched_prompts_match_solo_and_depend_on_the_image(vl_pipe):
    prompts = [('describe', IMAGES[0]), ('describe', IMAGES[1]), ('describe', [IMAGES[1], IMAGES[0]]), 'plain text']
    solo = [vl_pipe(p, gen_config=GREEDY).token_ids for p in prompts]
    batched = [r.token_ids for r in vl_pipe(prompts, gen_config=GREEDY)]
    assert batched == solo
    assert solo[0] != solo[1], 'a different image must change the answer'


def test_openai_messages_with_data_urls(vl_pipe):
    messages = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': data_url(IMAGES[0])}},
                                             {'type': 'text', 'text': 'describe'}]}]
    assert vl_pipe(messages, gen_config=GREEDY).token_ids == vl_pipe(('describe', IMAGES[0]),
                                                                      gen_config=GREEDY).token_ids


def test_prefix_cache_tells_images_apart(vl_model):
    pipe = pipeline(vl_model, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=4),
                    show_progress=False)
    try:
        text = 'describe this picture in a few words please'
        first = pipe((text, IMAGES[0]), gen_config=GREEDY)
        image = pipe.async_engine.processor.process((text, IMAGES[0])).multimodal[0]
        other = pipe((text, IMAGES[1].resize(IMAGES[0].size)), gen_config=GREEDY)
        assert other.cached_tokens <= image.offset, 'blocks holding another image must not be reused'
        again = pipe((text, IMAGES[0]), gen_config=GREEDY)
        assert again.cached_tokens > image.end, 'the same image is found in the cache again'
        assert again.token_ids == first.token_ids
        assert other.token_ids != first.token_ids
    finally:
        pipe.close()


def test_chunked_prefill_and_preemption_split_images(vl_model):
    """Prefill chunks of 5 tokens cut through every image, and a cache of 20 blocks of 4 forces preemption."""
    prompts = [('describe', IMAGES[:2]), ('look', IMAGES[1]), ('what is this', IMAGES[0])]
    config = PytorchEngineConfig(dtype='float32', num_gpu_blocks=20, block_size=4, max_prefill_token_num=5)
    pipe = pipeline(vl_model, config, show_progress=False)
    try:
        responses = pipe(prompts, gen_config=GREEDY)
        assert [r.error for r in responses] == [None] * 3
        outs = [r.token_ids for r in responses]
        assert pipe.async_engine.engine.scheduler.num_preemptions > 0
        assert outs == [reference(pipe, vl_model, p) for p in prompts]
    finally:
        pipe.close()


def test_bad_images_fail_alone(vl_pipe):
    full = png_bytes(IMAGES[0])
    truncated = data_url(full[:len(full) // 2])
    bad = [[{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': url}}]}]
           for url in (truncated, 'data:image/png;base64,bm90IGFuIGltYWdl', '/no/such/image.png')]
    outs = vl_pipe(bad + [('describe', IMAGES[0])], gen_config=GREEDY)
    assert [o.finish_reason for o in outs] == ['error'] * 3 + ['length']
    assert 'could not decode' in outs[0].error and 'could not decode' in outs[1].error
    engine = vl_pipe.async_engine.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_placeholder_count_must_match(vl_pipe):
    with pytest.raises(SafeRunException, match='image placeholders'):
        vl_pipe.encode(('no placeholder here', IMAGES[0]), do_preprocess=False)


def test_too_many_images(vl_pipe):
    with pytest.raises(SafeRunException, match='at most'):
        vl_pipe.encode(('many', [IMAGES[0]] * 17))


def test_text_only_model_rejects_images(tiny_llama):
    pipe = pipeline(tiny_llama, PytorchEngineConfig(dtype='float32', num_gpu_blocks=16, block_size=16),
                    show_progress=False)
    try:
        out = pipe(('describe', IMAGES[0]), gen_config=GREEDY)
        assert out.finish_reason == 'error' and 'does not accept images' in out.error
    finally:
        pipe.close()


def test_chat_template_beside_the_processor(vl_model, tmp_path):
    """LLaVA-style folders keep the template in chat_template.json, not in the tokenizer config."""
    import json
    import shutil

    from lmdeploy.tokenizer import Tokenizer
    path = shutil.copytree(vl_model, tmp_path / 'model')
    config = json.loads((path / 'tokenizer_config.json').read_text())
    template = config.pop('chat_template', None) or (path / 'chat_template.jinja').read_text()
    (path / 'chat_template.jinja').unlink(missing_ok=True)
    (path / 'tokenizer_config.json').write_text(json.dumps(config))
    (path / 'chat_template.json').write_text(json.dumps({'chat_template': template}))
    messages = [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': 'hi'}]}]
    assert Tokenizer(str(path)).apply_chat_template(messages) == Tokenizer(vl_model).apply_chat_template(messages)


def test_a_text_model_imports_no_family_preprocessing_module():
    """SmolVLM's and LFM2-VL's preprocessing (and their transformers processors, seconds to import) load only when
    their family is served."""
    code = ('import sys\nfrom transformers import LlamaConfig\nfrom lmdeploy.vl.image_inputs import ImageInputs\n'
            'assert ImageInputs.for_model(".", LlamaConfig(), None) is None\n'
            'loaded = [m for m in sys.modules if m.startswith(("lmdeploy.vl.smolvlm", "lmdeploy.vl.lfm2", '
            '"transformers.models.smolvlm", "transformers.models.lfm2_vl"))]\nassert not loaded, loaded')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
