"""Mistral 3 (Mistral Small 3.1 / 3.2: Pixtral tower, patch-merging projector, Mistral language model) against
transformers on tiny random models saved by transformers, fed by the tower's last layer and by its first
(``vision_feature_layer`` -2), and with a Ministral 3 language model (YaRN, queries scaled by their position): the
prompt's tokens and pixels as transformers' processor makes them, 32 greedy tokens and first-step logits in fp32 on
text, one-image and two-image prompts (images of different sizes), batching, chunked prefill through images,
prefix-cache hits, a server chat whose image is a data URL, transformers 5's module names loading like the hub's, the
language model in the native decoder stack (bf16), and clear errors for a span that is not the image's layout, for a
language model other than Mistral's or Ministral 3's and for several feature layers (transformers' projector
normalizes one layer's width); a hub-style config's output layer stays untied."""
from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from family_checks import assert_batched_chunked_and_cached_equal_solo, assert_vl_matches_transformers
from helpers import make_engine, run
from server_helpers import serve, tiny_engine
from test_vl import data_url
from test_vl_families import make_processor
from test_vl_server import chat, image_message
from vl_models import hf_vl_model, random_image, save_tiny_vl_model

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.vl.processor import ProcessedPrompt

# sized by the image processor to 64 x 96, 64 x 64 and 128 x 64 pixels: 2 x 3, 2 x 2 and 4 x 2 merged patches
IMAGES = [random_image(1), random_image(2, (60, 60)), random_image(3, (40, 100))]
PROMPTS = ['plain text', ('describe', IMAGES[0]), ('compare', [IMAGES[1], IMAGES[2]])]
PROMPT_IMAGES = [[], IMAGES[:1], IMAGES[1:]]
MERGED_PATCH = 32


@pytest.fixture(scope='module', params=['mistral3', 'mistral3_first_layer', 'mistral3_ministral3'])
def mistral3(request, tmp_path_factory) -> str:
    return save_tiny_vl_model(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def prompts(mistral3) -> list[ProcessedPrompt]:
    return [make_processor(mistral3).process(prompt) for prompt in PROMPTS]


@pytest.fixture(scope='module')
def hf_model(mistral3):
    return hf_vl_model(mistral3)


def transformers_pixels(path: str, images: list) -> dict[str, torch.Tensor]:
    """What ``PixtralProcessor`` gives for ``images``: its image processor on all of them at once, in merged
    patches, padded to the largest."""
    image_processor = make_processor(path).image_inputs.image_processor
    return image_processor(images=images, patch_size={'height': MERGED_PATCH, 'width': MERGED_PATCH},
                           return_tensors='pt').data


def image_span(height: int, width: int) -> str:
    """``PixtralProcessor.replace_image_token``'s text for an image (that processor needs torchvision)."""
    tokens = (['[IMG]'] * (width // MERGED_PATCH) + ['[IMG_BREAK]']) * (height // MERGED_PATCH)
    tokens[-1] = '[IMG_END]'
    return ''.join(tokens)


def hf_inputs(path: str, prompt: ProcessedPrompt, images: list) -> dict[str, torch.Tensor]:
    ids = torch.tensor([prompt.input_ids])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **(transformers_pixels(path, images) if images
                                                                       else {}))


def test_prompt_tokens_and_pixels_are_those_of_transformers_processor(mistral3, prompts):
    processor = make_processor(mistral3)
    for prompt, processed, images in zip(PROMPTS[1:], prompts[1:], PROMPT_IMAGES[1:]):
        expected = transformers_pixels(mistral3, images)
        parts = processor.render(prompt, images=[]).split('[IMG]')
        text = parts[0] + ''.join(image_span(*size.tolist()) + part
                                  for size, part in zip(expected['image_sizes'], parts[1:]))
        assert processed.input_ids == processor.tokenizer.encode(text, add_special_tokens=False)
        for image, size, pixels in zip(processed.multimodal, expected['image_sizes'], expected['pixel_values']):
            height, width = size.tolist()
            assert image.data['image_sizes'].tolist() == [[height, width]]
            assert torch.equal(image.data['pixel_values'][0], pixels[:, :height, :width])
            assert image.length == (height // MERGED_PATCH) * (width // MERGED_PATCH + 1)
    assert [m.data['image_sizes'].tolist() for m in prompts[2].multimodal] == [[[64, 64]], [[128, 64]]]


def test_greedy_and_first_logits_match_transformers(mistral3, prompts, hf_model):
    inputs = [hf_inputs(mistral3, prompt, images) for prompt, images in zip(prompts, PROMPT_IMAGES)]
    outs = assert_vl_matches_transformers(mistral3, hf_model, prompts, inputs)
    assert outs[1] != outs[2], 'the images must change the answer'


def test_batched_chunked_and_cached_equal_solo(mistral3, prompts):
    # chunks of 5 tokens cut through the images' rows; the image prompts are cached
    assert_batched_chunked_and_cached_equal_solo(
        mistral3, prompts, chunked={'block_size': 4, 'max_prefill_token_num': 5}, cached={'block_size': 4},
        warm=slice(1, None))


@pytest.fixture
def mistral3_server(mistral3):  # the name test_vl_server's chat asks for
    yield from serve(tiny_engine(mistral3), model_name='tiny-vl')


def test_server_chat_with_a_data_url_image_matches_transformers(mistral3_server, mistral3, hf_model):
    messages = image_message(data_url(IMAGES[2]))
    prompt = mistral3_server.engine.processor.process(messages)
    expected = hf_model.generate(**hf_inputs(mistral3, prompt, IMAGES[2:]), max_new_tokens=10, do_sample=False,
                                 top_k=None, top_p=None, temperature=None)[0, len(prompt.input_ids):]
    client = openai.OpenAI(base_url=f'{mistral3_server.url}/v1', api_key='none', max_retries=0)
    reply = chat(client, messages)
    assert reply.choices[0].message.content == mistral3_server.engine.tokenizer.decode(expected.tolist())
    assert reply.usage.prompt_tokens == len(prompt.input_ids)


def test_a_span_that_is_not_the_images_layout_is_refused(mistral3, prompts):
    engine = make_engine(mistral3)
    prompt = prompts[1]
    image = prompt.multimodal[0]
    all_image_tokens = list(prompt.input_ids)
    all_image_tokens[image.offset:image.end] = [all_image_tokens[image.offset]] * image.length
    with pytest.raises(ValueError, match='span of image placeholder tokens'):
        engine.add_request(all_image_tokens, multimodal=[image])
    shorter = type(image)(image.offset, image.length - 1, image.content_hash, image.data)
    with pytest.raises(ValueError, match='spans 8 tokens, not 7'):
        engine.add_request(prompt.input_ids, multimodal=[shorter])
    unsized = type(image)(image.offset, image.length, image.content_hash, {'pixel_values': image.data['pixel_values']})
    with pytest.raises(ValueError, match="needs its 'image_sizes'"):
        engine.add_request(prompt.input_ids, multimodal=[unsized])
    assert run(engine, [prompt]) == run(make_engine(mistral3), [prompt]), 'the engine goes on'


def test_a_language_model_other_than_mistrals_is_refused(tmp_path):
    path = shutil.copytree(save_tiny_vl_model('mistral3', str(tmp_path / 'saved')), tmp_path / 'ministral')
    config = json.loads((path / 'config.json').read_text())
    config['text_config']['model_type'] = 'qwen2'
    (path / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'qwen2' language model is not supported"):
        make_engine(str(path))


def test_several_vision_feature_layers_are_refused(tmp_path):
    path = save_tiny_vl_model('mistral3', str(tmp_path / 'saved'))
    config = json.loads((tmp_path / 'saved' / 'config.json').read_text())
    config['vision_feature_layer'] = [-2, -1]
    (tmp_path / 'saved' / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ValueError, match='one vision_feature_layer'):
        make_engine(path)


def transformers5_name(name: str) -> str:
    """A checkpoint name (hub layout, as transformers also saves it) in transformers 5's module layout."""
    if name == 'language_model.lm_head.weight':
        return 'lm_head.weight'
    if name.startswith('language_model.model.'):
        return 'model.language_model.' + name.removeprefix('language_model.model.')
    return 'model.' + name


def test_transformers5_module_layout_loads_like_the_hubs(tmp_path):
    path = save_tiny_vl_model('mistral3', str(tmp_path / 'hub'))
    renamed = shutil.copytree(path, tmp_path / 'transformers5')
    for file in renamed.glob('*.safetensors'):
        tensors = load_file(file)
        assert 'language_model.model.embed_tokens.weight' in tensors and 'vision_tower.ln_pre.weight' in tensors
        save_file({transformers5_name(name): t for name, t in tensors.items()}, file, metadata={'format': 'pt'})
    prompts = [make_processor(path).process(PROMPTS[2])]
    assert run(make_engine(str(renamed)), prompts) == run(make_engine(path), prompts)


@pytest.mark.parametrize('kind', ['mistral3', 'mistral3_ministral3'])
def test_language_model_runs_in_the_native_decoder_stack(kind, tmp_path, native_gemms):
    """bf16 on packed weights: the Mistral (and Ministral 3) layers run in the native decoder stack, as their own
    forward does."""
    path = save_tiny_vl_model(kind, str(tmp_path / kind))
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16), show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None
    prompts = [make_processor(path).process(prompt) for prompt in PROMPTS]
    outs = run(engine, prompts)
    model.native_stack = None
    assert run(engine, prompts) == outs


def test_a_config_without_the_top_level_tie_flag_keeps_its_own_output_layer(tmp_path):
    """The hub's Mistral Small 3.1 / 3.2 configs name ``tie_word_embeddings`` only in ``text_config`` (false), so
    transformers 5 reads its ``Mistral3Config`` default (true), then unties: the checkpoint holds an output layer of
    its own. The engine takes the text config's flag and gives transformers' tokens."""
    path = save_tiny_vl_model('mistral3', str(tmp_path / 'mistral3'))
    config = json.loads((tmp_path / 'mistral3' / 'config.json').read_text())
    del config['tie_word_embeddings']
    (tmp_path / 'mistral3' / 'config.json').write_text(json.dumps(config))
    hf_model = hf_vl_model(path)
    assert hf_model.config.tie_word_embeddings and not torch.equal(hf_model.lm_head.weight,
                                                                   hf_model.get_input_embeddings().weight)
    prompt = make_processor(path).process(PROMPTS[1])
    expected = hf_model.generate(**hf_inputs(path, prompt, PROMPT_IMAGES[1]), max_new_tokens=32, do_sample=False,
                                 top_k=None, top_p=None, temperature=None)
    assert run(make_engine(path), [prompt]) == [expected[0, len(prompt.input_ids):].tolist()]
