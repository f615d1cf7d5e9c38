"""LFM2-VL (``Lfm2VlForConditionalGeneration``) against transformers on a tiny random model saved by transformers: a
SigLIP2 NaFlex tower on 4 px patches, tiles of 32 px (16 tokens after the 2 x 2 pixel unshuffle) and a thumbnail for
images past 2048 px, smaller ones smart-resized alone, and an LFM2 text model (short convolutions and attention).
The spans ``Lfm2VlProcessor`` writes, the tiling rules against transformers' own functions, 32 greedy tokens and
first-step logits in fp32 on text, one-image and two-image prompts, batching, chunked prefill and preemption equal to
solo runs (prefix caching is off for this recurrent model), a server chat with a data-URL image, clear errors for
spans and tensors that do not fit, and tensor parallelism refused."""
from __future__ import annotations

import ast
import json
import math
import os
import shutil
from functools import lru_cache

import httpx
import openai
import pytest
import torch
from conftest import build_tokenizer
from safetensors.torch import load_file, save_file
from PIL import Image
from family_checks import assert_slots_free, assert_vl_matches_transformers
from helpers import make_engine, run
from server_helpers import serve, tiny_engine
from test_vl import data_url, png_bytes
from test_vl_server import assert_image_chat_matches_transformers, chat, image_message
import transformers
from transformers import AutoConfig, AutoModelForImageTextToText, Lfm2VlConfig
from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor
from vl_models import hf_vl_model, image_chat_template, make_processor, random_image

from lmdeploy.pytorch.models.lfm2_vl import Lfm2VlForConditionalGeneration
from lmdeploy.vl.lfm2_vl_inputs import Lfm2VlImageInputs
from lmdeploy.vl.processor import ProcessedPrompt

MAX_TILES = 4
GRID_TOKENS = [f'<|img_row_{r}_col_{c}|>' for r in range(1, MAX_TILES + 1) for c in range(1, MAX_TILES + 1)]
IMAGE_TOKENS = ['<image>', '<|image_start|>', '<|image_end|>', '<|img_thumbnail|>'] + GRID_TOKENS
TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=352, num_hidden_layers=4,
            layer_types=['conv', 'full_attention', 'conv', 'full_attention'], intermediate_size=144,
            block_ffn_dim_multiplier=1.0, block_multiple_of=40, conv_L_cache=3, max_position_embeddings=1024)
# 4 x 4 learned positions, resized to each tile's grid of patches
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
              num_patches=16, vision_use_head=False)
PREPROCESSOR = {'image_processor_type': 'Lfm2VlImageProcessor', 'downsample_factor': 2, 'do_image_splitting': True,
                'min_tiles': 2, 'max_tiles': MAX_TILES, 'use_thumbnail': True, 'min_image_tokens': 4,
                'max_image_tokens': 16, 'encoder_patch_size': 4, 'tile_size': 32, 'max_pixels_tolerance': 2.0,
                'resample': 2, 'image_mean': [0.5] * 3, 'image_std': [0.5] * 3}
# tiles (rows x cols): 1 x 2 plus the thumbnail, 1 x 1 (smart-resized alone), 2 x 2 plus the thumbnail
IMAGES = [random_image(1, (100, 50)), random_image(2, (40, 30)), random_image(3, (90, 100))]
TILES = [(1, 2), (1, 1), (2, 2)]
PROMPTS = ['plain text', ('describe', IMAGES[0]), ('compare', [IMAGES[1], IMAGES[2]])]


def save_tiny_lfm2_vl(path: str, vision: dict = VISION, preprocessor: dict = PREPROCESSOR) -> str:
    """Model, tokenizer (a ChatML template writing ``<image>``, LFM2-VL's image tokens) and image processor settings
    (``vision``: the tower's config, ``preprocessor``: ``preprocessor_config.json``)."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': IMAGE_TOKENS})
    tokenizer.chat_template = image_chat_template('<image>')
    text = TEXT | {'eos_token_id': tokenizer.eos_token_id, 'bos_token_id': tokenizer.bos_token_id}
    config = Lfm2VlConfig(text_config=text, vision_config=vision, projector_hidden_size=48,
                          image_token_id=tokenizer.convert_tokens_to_ids('<image>'), downsample_factor=2)
    config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.2 if '.language_model.' in name else 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, 'preprocessor_config.json'), 'w') as f:
        json.dump(preprocessor, f)
    return path


@pytest.fixture(scope='module')
def lfm2_vl(tmp_path_factory) -> str:
    return save_tiny_lfm2_vl(str(tmp_path_factory.mktemp('lfm2_vl')))


@pytest.fixture(scope='module')
def prompts(lfm2_vl) -> list[ProcessedPrompt]:
    return [make_processor(lfm2_vl).process(prompt) for prompt in PROMPTS]


@pytest.fixture(scope='module')
def hf_model(lfm2_vl):
    return hf_vl_model(lfm2_vl)


def hf_inputs(prompt: ProcessedPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs: the prompt's ids and the tiles of all its images, in order."""
    ids = torch.tensor([prompt.input_ids])
    images = {key: torch.cat([m.data[key] for m in prompt.multimodal])
              for key in ('pixel_values', 'pixel_attention_mask', 'spatial_shapes')} if prompt.multimodal else {}
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **images)


def test_spans_are_those_of_transformers_processor(lfm2_vl, prompts):
    """Each ``<image>`` the chat template writes becomes ``Lfm2VlProcessor``'s text for the image's tiles (its
    ``replace_image_token`` given the tiling), from ``<|image_start|>`` to ``<|image_end|>``."""
    processor = make_processor(lfm2_vl)
    names = Lfm2VlProcessor.__new__(Lfm2VlProcessor)
    names.image_token, names.image_start_token, names.image_end_token, names.image_thumbnail_token = IMAGE_TOKENS[:4]
    tile_tokens = (32 // 4 // 2)**2
    for prompt, processed, tiles in zip(PROMPTS[1:], prompts[1:], [TILES[:1], TILES[1:]]):
        parts = processor.render(prompt, images=[]).split('<image>')
        assert len(parts) == len(tiles) + 1
        text = parts[0]
        for (rows, cols), image, part in zip(tiles, processed.multimodal, parts[1:]):
            assert image.data['tile_grid'].tolist() == [[rows, cols]]
            height, width = image.data['spatial_shapes'][-1].tolist()
            assert len(image.data['pixel_values']) == rows * cols + (rows * cols > 1)
            text += Lfm2VlProcessor._build_image_tokens(names, rows, cols, tile_tokens, height * width // 4,
                                                        True, True) + part
        assert processed.input_ids == processor.tokenizer.encode(text, add_special_tokens=False)
    for image, processed in zip(IMAGES, [prompts[1].multimodal[0], *prompts[2].multimodal]):
        assert processor.image_inputs.least_tokens(image.size) == processed.length, 'known from the size alone'


def lfm2_vl_tiling_functions() -> dict:
    """The tiling functions of transformers' ``image_processing_lfm2_vl`` (a module that imports torchvision, which
    this environment lacks), compiled from its source alone; its processor's methods bound to its defaults."""
    path = os.path.join(os.path.dirname(transformers.__file__), 'models', 'lfm2_vl', 'image_processing_lfm2_vl.py')
    with open(path) as f:
        tree = ast.parse(f.read())
    processor = next(node for node in tree.body
                     if isinstance(node, ast.ClassDef) and node.name == 'Lfm2VlImageProcessor')
    methods = {'_target_ratios', '_get_grid_layout', 'smart_resize', '_is_image_too_large', '_get_split_layout'}
    processor.bases, processor.decorator_list = [], []
    processor.body = [node for node in processor.body if isinstance(node, ast.FunctionDef) and node.name in methods]
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and
                 node.name in ('round_by_factor', 'find_closest_aspect_ratio')]
    namespace = {'math': math, 'lru_cache': lru_cache}
    exec(compile(ast.Module(functions + [processor], []), path, 'exec'), namespace)
    return namespace


@pytest.mark.parametrize('settings', [PREPROCESSOR, {'image_processor_type': 'Lfm2VlImageProcessor'}])
def test_tiling_is_transformers(tmp_path, settings):
    """The tiles and the smart resize transformers' ``Lfm2VlImageProcessor._get_split_layout`` picks, over images
    from 1 px to past the largest grid, with the tiny model's settings and the released checkpoints' (defaults)."""
    (tmp_path / 'preprocessor_config.json').write_text(json.dumps(settings))
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': IMAGE_TOKENS})
    config = Lfm2VlConfig(vision_config={'patch_size': settings.get('encoder_patch_size', 16)},
                          image_token_id=tokenizer.convert_tokens_to_ids('<image>'))
    inputs = Lfm2VlImageInputs(str(tmp_path), config, tokenizer)
    reference = lfm2_vl_tiling_functions()['Lfm2VlImageProcessor']()
    s = inputs.settings
    layout = {key: getattr(s, key) for key in ('downsample_factor', 'min_tiles', 'max_tiles', 'min_image_tokens',
                                               'max_image_tokens', 'encoder_patch_size', 'tile_size',
                                               'max_pixels_tolerance')}
    largest, step = (3000, 37) if s.tile_size == 512 else (200, 3)
    for height in range(1, largest, step):
        for width in range(1, largest, step + 4):
            _, rows, cols, new_height, new_width = reference._get_split_layout(height, width, **layout)
            assert inputs._layout(height, width) == (rows, cols, new_height, new_width), (height, width)


def test_greedy_and_first_logits_match_transformers(lfm2_vl, prompts, hf_model):
    outs = assert_vl_matches_transformers(lfm2_vl, hf_model, prompts, [hf_inputs(p) for p in prompts])
    assert len(set(outs[0])) > 2, 'the tiny model must not repeat one token'
    assert outs[1] != outs[2], 'the images must change the answer'


def test_another_image_changes_the_answer(lfm2_vl, prompts):
    other = make_processor(lfm2_vl).process(('describe', random_image(9, (100, 50))))
    assert len(other.input_ids) == len(prompts[1].input_ids)
    assert run(make_engine(lfm2_vl), [other]) != run(make_engine(lfm2_vl), [prompts[1]])


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(lfm2_vl, prompts):
    """Batched with text, in prefill chunks of 5 tokens cutting through the images' tiles, and preempted (the
    convolution states recomputed from zero, the image encoded again) as alone; every slot and block given back."""
    plain = run(make_engine(lfm2_vl), prompts)
    assert [run(make_engine(lfm2_vl), [p])[0] for p in prompts] == plain
    chunked = make_engine(lfm2_vl, block_size=4, max_prefill_token_num=5)
    assert run(chunked, prompts) == plain
    assert_slots_free(chunked)
    tight = make_engine(lfm2_vl, block_size=4, num_gpu_blocks=2 + max(len(p.input_ids) for p in prompts) // 4 + 8)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_a_span_or_tensors_that_do_not_fit_the_tiles_are_refused(lfm2_vl, prompts):
    engine = make_engine(lfm2_vl)
    prompt = prompts[1]
    image = prompt.multimodal[0]
    all_images = list(prompt.input_ids)
    all_images[image.offset:image.end] = [engine.model_config.mm_config.image_token_id] * image.length
    with pytest.raises(ValueError, match='span of image placeholder tokens'):
        engine.add_request(all_images, multimodal=[image])
    shorter = type(image)(image.offset, image.length - 1, image.content_hash, image.data)
    with pytest.raises(ValueError, match=f'spans {image.length} tokens, not {image.length - 1}'):
        engine.add_request(prompt.input_ids, multimodal=[shorter])
    one_tile = type(image)(image.offset, image.length, image.content_hash,
                           {key: value[:1] for key, value in image.data.items()})
    with pytest.raises(ValueError, match='image of 1 x 2 tiles has 1 tiles of pixels'):
        engine.add_request(prompt.input_ids, multimodal=[one_tile])
    fewer_pixels = type(image)(image.offset, image.length, image.content_hash,
                               {**image.data, 'pixel_values': image.data['pixel_values'][:1]})
    with pytest.raises(ValueError, match='do not fit together'):
        engine.add_request(prompt.input_ids, multimodal=[fewer_pixels])
    unmasked = type(image)(image.offset, image.length, image.content_hash,
                           {**image.data, 'pixel_attention_mask': torch.ones_like(image.data['pixel_attention_mask'])})
    with pytest.raises(ValueError, match='as many unmasked patches'):
        engine.add_request(prompt.input_ids, multimodal=[unmasked])
    no_grid = type(image)(image.offset, image.length, image.content_hash,
                          {key: value for key, value in image.data.items() if key != 'tile_grid'})
    with pytest.raises(ValueError, match=r"missing \['tile_grid'\]"):
        engine.add_request(prompt.input_ids, multimodal=[no_grid])
    assert not engine.sequences
    assert run(engine, [prompt]) == run(make_engine(lfm2_vl), [prompt]), 'the engine goes on'


def test_a_tokenizer_whose_image_token_is_not_the_configs_is_refused(lfm2_vl):
    with pytest.raises(ValueError, match="is not the config's image_token_id"):
        Lfm2VlImageInputs(lfm2_vl, AutoConfig.from_pretrained(lfm2_vl), build_tokenizer())


def test_model_is_built_as_the_config_says(lfm2_vl):
    model = make_engine(lfm2_vl).runner.model
    assert isinstance(model, Lfm2VlForConditionalGeneration)
    assert [layer.is_conv for layer in model.layers] == [True, False, True, False]
    assert len(model.vision_tower.encoder.layers) == 2


def test_the_hubs_tower_names_load(lfm2_vl, prompts, tmp_path):
    """The hub's files name the tower ``model.vision_tower.vision_model.*`` (saved before transformers 5 dropped
    that level): the same model, the same tokens."""
    hub = shutil.copytree(lfm2_vl, tmp_path / 'hub')
    for file in hub.glob('*.safetensors'):
        tensors = load_file(file)
        assert any(name.startswith('model.vision_tower.encoder.') for name in tensors)
        save_file({name.replace('model.vision_tower.', 'model.vision_tower.vision_model.'): t
                   for name, t in tensors.items()}, file, metadata={'format': 'pt'})
    assert run(make_engine(str(hub)), prompts[1:2]) == run(make_engine(lfm2_vl), prompts[1:2])


def test_tensor_parallelism_is_refused(lfm2_vl):
    with pytest.raises(ValueError, match='short-convolution layers are not sharded for tensor parallelism'):
        make_engine(lfm2_vl, tp=2)


@pytest.fixture(scope='module')
def lfm2_vl_server(lfm2_vl):
    yield from serve(tiny_engine(lfm2_vl), model_name='tiny-vl')


def test_server_chat_with_a_data_url_image_matches_transformers(lfm2_vl_server, hf_model):
    assert_image_chat_matches_transformers(lfm2_vl_server, hf_model, hf_inputs, IMAGES[2])


def test_prompt_pixels_and_metadata_are_those_of_the_torchvision_processor(lfm2_vl, tmp_path):
    """transformers' ``Lfm2VlProcessor`` on torchvision (``tests/test_vl_torchvision_reference.py``'s subprocess)
    writes the same token ids and gives the same tiles, masks and patch grids, and pixels to float32 rounding, at the
    tiny model's settings and at the released checkpoints' (transformers' defaults: 512 px tiles of 16 px patches)."""
    from test_vl_torchvision_reference import IMAGES as PICTURES
    from test_vl_torchvision_reference import TORCHVISION, reference_outputs
    if not os.path.isdir(TORCHVISION):
        pytest.skip(f'no torchvision wheel in {TORCHVISION} (.ci/run puts it there)')
    released = tmp_path / 'released'
    shutil.copytree(lfm2_vl, released, ignore=shutil.ignore_patterns('*.safetensors'))
    (released / 'preprocessor_config.json').write_text(json.dumps({'image_processor_type': 'Lfm2VlImageProcessor'}))
    config = json.loads((released / 'config.json').read_text())
    config['vision_config']['patch_size'] = 16
    (released / 'config.json').write_text(json.dumps(config))
    names = ['tiny', 'small', 'large', 'wide', 'tall']  # transformers' processor fails on grayscale (no RGB)
    paths = {name: str(tmp_path / f'{name}.png') for name in names}
    for name in names:
        PICTURES[name].save(paths[name])
    processed, jobs = [], []
    for checkpoint in (str(shutil.copytree(lfm2_vl, tmp_path / 'tiny')), str(released)):
        with open(os.path.join(checkpoint, 'processor_config.json'), 'w') as f:
            json.dump({'processor_class': 'Lfm2VlProcessor'}, f)
        processor = make_processor(checkpoint)
        for name in names:
            prompt = ('describe', Image.open(paths[name]))
            processed.append((name, processor.process(prompt)))
            jobs.append({'checkpoint': checkpoint, 'text': processor.render(prompt, images=[]),
                         'images': [paths[name]]})
    for (name, prompt), reference in zip(processed, reference_outputs(jobs, str(tmp_path))):
        assert reference['backend'] == 'torchvision'
        assert prompt.input_ids == reference['input_ids'][0].tolist(), name
        data = prompt.multimodal[0].data
        for key in ('pixel_attention_mask', 'spatial_shapes'):
            assert torch.equal(data[key], reference[key].to(data[key].dtype)), (name, key)
        assert data['pixel_values'].shape == reference['pixel_values'].shape, name
        assert (data['pixel_values'] - reference['pixel_values']).abs().max() <= 1e-6, name


def test_bad_images_are_400_and_the_server_goes_on(lfm2_vl_server):
    """Broken bytes, a truncated PNG, a 1 x 16000 image and more images than a prompt may hold are each refused with
    an OpenAI-style 400 before any reaches the engine; the next request gets its answer, nothing held."""
    client = openai.OpenAI(base_url=f'{lfm2_vl_server.url}/v1', api_key='none', max_retries=0)
    good = image_message(data_url(IMAGES[1]))
    expected = chat(client, good).choices[0].message.content
    full = png_bytes(IMAGES[0])
    too_many = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': data_url(IMAGES[1])}}] * 17
                 + [{'type': 'text', 'text': 'compare'}]}]
    for messages, reason in [(image_message(data_url(b'not an image')), 'image'),
                             (image_message(data_url(full[:len(full) // 2])), 'image'),
                             (image_message(data_url(Image.new('RGB', (1, 16000)))), 'times its shortest'),
                             (too_many, 'at most 16 images')]:
        response = httpx.post(f'{lfm2_vl_server.url}/v1/chat/completions', timeout=60,
                              json={'model': 'tiny-vl', 'messages': messages, 'max_tokens': 4})
        assert response.status_code == 400, response.text
        error = response.json()['error']
        assert set(error) == {'message', 'type', 'param', 'code'} and reason in error['message'], error
    assert chat(client, good).choices[0].message.content == expected
    metrics = lfm2_vl_server.metrics()
    assert metrics['lmdeploy:num_requests_running'] == 0 and metrics['lmdeploy:kv_cache_usage_perc'] == 0
