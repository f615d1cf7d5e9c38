"""Llama 4 with images (``Llama4ForConditionalGeneration``) against transformers on a tiny random model saved by
transformers: a vision tower on 56 px tiles of 14 px patches (4 tokens a tile after the pixel shuffle), images cut
into up to 4 tiles plus a global tile, a Llama 4 text model with chunked attention (chunk 8), a NoPE layer and MoE
layers. Its prompts' spans as transformers' ``Llama4Processor`` writes them, 32 greedy tokens and first-step logits
in fp32 on text, one-image and two-image prompts, batching, chunked prefill, prefix-cache hits, blocks given back,
a server chat with a data-URL image, and clear errors for spans and pixels that do not fit the image's tiles."""
from __future__ import annotations

import ast
import json
import math
import os
import shutil
from collections import defaultdict
from functools import lru_cache

import pytest
import torch
from conftest import build_tokenizer
from safetensors.torch import load_file, save_file
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_tp2_equals_tp1,
                           assert_vl_matches_transformers)
from helpers import make_engine, run
from server_helpers import serve, tiny_engine
from test_llama4 import CONFIG as TEXT_CONFIG
from test_vl_families import make_processor
from test_vl_server import assert_image_chat_matches_transformers
import transformers
from transformers import AutoConfig, AutoModelForImageTextToText, Llama4Config, Llama4VisionConfig
from transformers.image_utils import SizeDict
from transformers.models.llama4.modeling_llama4 import Llama4VisionRotaryEmbedding
from transformers.models.llama4.processing_llama4 import Llama4Processor, chat_template
from transformers.models.mllama.image_processing_pil_mllama import (get_image_size_fit_to_canvas,
                                                                    get_optimal_tiled_canvas)
from vl_models import hf_vl_model, random_image

from lmdeploy.pytorch.models.llama4_vl import Llama4ForConditionalGeneration, patch_rotary_angles
from lmdeploy.vl.image_inputs import Llama4ImageInputs
from lmdeploy.vl.processor import ProcessedPrompt

IMAGE_TOKENS = ['<|image|>', '<|image_start|>', '<|image_end|>', '<|patch|>', '<|tile_x_separator|>',
                '<|tile_y_separator|>']
TEMPLATE_TOKENS = ['<|header_start|>', '<|header_end|>', '<|eot|>']
TILE = 56
# hidden 32 pixel-shuffled (ratio 0.5) into 128 features, the adapter's width 48 = the projector's input
VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
              patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=48, projector_output_dim=48,
              vision_output_dim=48, rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0})
PREPROCESSOR = {'image_processor_type': 'Llama4ImageProcessorFast', 'size': {'height': TILE, 'width': TILE},
                'max_patches': 4, 'resample': 2, 'rescale_factor': 1 / 255, 'image_mean': [0.5] * 3,
                'image_std': [0.5] * 3, 'do_resize': True, 'do_rescale': True, 'do_normalize': True,
                'do_convert_rgb': True, 'resize_to_max_canvas': False}
# tiles (rows x cols): 1 x 2 plus the global one, 1 x 1, 2 x 2 plus the global one
IMAGES = [random_image(1, (100, 50)), random_image(2, (40, 40)), random_image(3, (100, 90))]
TILES = [(1, 2), (1, 1), (2, 2)]
PROMPTS = ['plain text', ('describe', IMAGES[0]), ('compare', [IMAGES[1], IMAGES[2]])]


def save_tiny_llama4_vl(path: str) -> str:
    """Model, tokenizer (the Llama 4 chat template, its special tokens) and image processor settings in ``path``."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': TEMPLATE_TOKENS + IMAGE_TOKENS})
    tokenizer.chat_template = chat_template
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in IMAGE_TOKENS}
    text = TEXT_CONFIG | {'vocab_size': 336, 'eos_token_id': tokenizer.eos_token_id, 'model_type': 'llama4_text'}
    config = Llama4Config(text_config=text, vision_config=VISION, image_token_index=ids['<|patch|>'],
                          boi_token_index=ids['<|image_start|>'], eoi_token_index=ids['<|image_end|>'])
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.2 if name.startswith('language_model.') else 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, 'preprocessor_config.json'), 'w') as f:
        json.dump(PREPROCESSOR, f)
    return path


@pytest.fixture(scope='module')
def llama4_vl(tmp_path_factory) -> str:
    return save_tiny_llama4_vl(str(tmp_path_factory.mktemp('llama4_vl')))


@pytest.fixture(scope='module')
def prompts(llama4_vl) -> list[ProcessedPrompt]:
    return [make_processor(llama4_vl).process(prompt) for prompt in PROMPTS]


@pytest.fixture(scope='module')
def hf_model(llama4_vl):
    return hf_vl_model(llama4_vl)


def hf_inputs(prompt: ProcessedPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs: the prompt's ids and the tiles of all its images, in order."""
    ids = torch.tensor([prompt.input_ids])
    pixels = {'pixel_values': torch.cat([m.data['pixel_values'] for m in prompt.multimodal])} if prompt.multimodal \
        else {}
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels)


def test_spans_are_those_of_transformers_processor(llama4_vl, prompts):
    """Each ``<|image|>`` the chat template writes becomes ``Llama4Processor``'s text for the image's tiles; the
    image's span runs from ``<|image_start|>`` to ``<|image_end|>``, with one tile of pixels per tile and the
    global one."""
    processor = make_processor(llama4_vl)
    tokens_per_tile = (TILE // 14)**2 // 4
    for prompt, processed, tiles in zip(PROMPTS[1:], prompts[1:], [TILES[:1], TILES[1:]]):
        parts = processor.render(prompt, images=[]).split('<|image|>')
        assert len(parts) == len(tiles) + 1
        text = parts[0] + ''.join(Llama4Processor._prompt_split_image(None, ratio, tokens_per_tile) + part
                                  for ratio, part in zip(tiles, parts[1:]))
        assert processed.input_ids == processor.tokenizer.encode(text, add_special_tokens=False)
        for image, (rows, cols) in zip(processed.multimodal, tiles):
            assert image.data['aspect_ratios'].tolist() == [[rows, cols]]
            assert image.data['pixel_values'].shape == (rows * cols + (rows * cols > 1), 3, TILE, TILE)
            span = processor.tokenizer.decode(processed.input_ids[image.offset:image.end], skip_special_tokens=False)
            assert span.startswith('<|image_start|>') and span.endswith('<|image_end|>')


def llama4_tiling_functions() -> dict:
    """The canvas and resize functions of transformers' ``image_processing_llama4`` (a module that imports torchvision,
    which this environment lacks), compiled from its source alone."""
    path = os.path.join(os.path.dirname(transformers.__file__), 'models', 'llama4', 'image_processing_llama4.py')
    with open(path) as f:
        tree = ast.parse(f.read())
    names = {'get_factors', 'get_max_res_without_distortion', 'find_supported_resolutions', 'get_best_fit'}
    module = ast.Module([node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names], [])
    namespace = {'math': math, 'torch': torch, 'defaultdict': defaultdict, 'lru_cache': lru_cache,
                 'SizeDict': SizeDict}
    exec(compile(module, path, 'exec'), namespace)
    return namespace


@pytest.mark.parametrize('tile,max_tiles', [(336, 16), (56, 4)])
def test_mllamas_tiling_is_llama4s(tile, max_tiles):
    """Mllama's canvas and size functions, which the engine runs, pick Llama 4's canvas and resize to Llama 4's size
    (``Llama4ImageProcessor._preprocess``: never upscaled past one tile), over images of up to 4 1/2 tiles a side."""
    llama4 = llama4_tiling_functions()
    resolutions = torch.tensor(llama4['find_supported_resolutions'](max_tiles, SizeDict(height=tile, width=tile)))
    largest, step = (1500, 23) if tile == 336 else (400, 7)
    for height in range(1, largest, step):
        for width in range(1, largest, step + 6):
            canvas = tuple(int(side) for side in llama4['get_best_fit']((height, width), resolutions))
            limit = (min(max(height, tile), canvas[0]), min(max(width, tile), canvas[1]))
            resized = tuple(max(side, 1) for side in llama4['get_max_res_without_distortion']((height, width), limit))
            assert tuple(int(s) for s in get_optimal_tiled_canvas(height, width, max_tiles, tile)) == canvas
            assert get_image_size_fit_to_canvas(height, width, *canvas, tile) == resized


def test_greedy_and_first_logits_match_transformers(llama4_vl, prompts, hf_model):
    outs = assert_vl_matches_transformers(llama4_vl, hf_model, prompts, [hf_inputs(p) for p in prompts])
    assert len(set(outs[0])) > 2, 'the tiny model must not repeat one token'
    assert outs[1] != outs[2], 'the images must change the answer'
    assert len(prompts[2].input_ids) > 4 * TEXT_CONFIG['attention_chunk_size'], 'chunked attention must bite'


def test_another_image_changes_the_answer(llama4_vl, prompts):
    other = make_processor(llama4_vl).process(('describe', random_image(9, (100, 50))))
    assert len(other.input_ids) == len(prompts[1].input_ids)
    assert run(make_engine(llama4_vl), [other]) != run(make_engine(llama4_vl), [prompts[1]])


def test_batched_chunked_and_cached_equal_solo(llama4_vl, prompts):
    # chunks of 5 tokens cut through the images' tiles; blocks of 4 end cached prefixes inside images
    assert_batched_chunked_and_cached_equal_solo(
        llama4_vl, prompts, chunked={'block_size': 4, 'max_prefill_token_num': 5}, cached={'block_size': 4},
        warm=slice(1, None))


def test_image_requests_give_back_their_blocks(llama4_vl, prompts):
    """Every block comes back after image requests, the second time with prefix-cache hits inside them."""
    engine = make_engine(llama4_vl, block_size=4)
    expected = run(engine, prompts)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert run(engine, prompts) == expected
    assert engine.block_manager.num_hits > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_span_or_pixels_that_do_not_fit_the_tiles_are_refused(llama4_vl, prompts):
    engine = make_engine(llama4_vl)
    prompt = prompts[1]
    image = prompt.multimodal[0]
    all_patches = list(prompt.input_ids)
    all_patches[image.offset:image.end] = [engine.model_config.mm_config.image_token_id] * image.length
    with pytest.raises(ValueError, match='span of image placeholder tokens'):
        engine.add_request(all_patches, multimodal=[image])
    shorter = type(image)(image.offset, image.length - 1, image.content_hash, image.data)
    with pytest.raises(ValueError, match=f'spans {image.length} tokens, not {image.length - 1}'):
        engine.add_request(prompt.input_ids, multimodal=[shorter])
    one_tile = type(image)(image.offset, image.length, image.content_hash,
                           {**image.data, 'pixel_values': image.data['pixel_values'][:1]})
    with pytest.raises(ValueError, match=r'takes pixels of \[3, 3, 56, 56\], got \[1, 3, 56, 56\]'):
        engine.add_request(prompt.input_ids, multimodal=[one_tile])
    unshaped = type(image)(image.offset, image.length, image.content_hash,
                           {'pixel_values': image.data['pixel_values']})
    with pytest.raises(ValueError, match="needs its 'pixel_values' and 'aspect_ratios'"):
        engine.add_request(prompt.input_ids, multimodal=[unshaped])
    assert not engine.sequences
    assert run(engine, [prompt]) == run(make_engine(llama4_vl), [prompt]), 'the engine goes on'


def test_a_checkpoint_of_the_language_model_alone_serves_text(llama4_vl, prompts, tmp_path):
    """Without the vision tensors and the image processor's settings the same class loads, gives the full model's
    tokens on text, and refuses images with a clear error."""
    text_only = shutil.copytree(llama4_vl, tmp_path / 'text_only')
    (text_only / 'preprocessor_config.json').unlink()
    for file in text_only.glob('*.safetensors'):
        tensors = load_file(file)
        assert any(name.startswith('vision_model.') for name in tensors)
        save_file({name: t for name, t in tensors.items()
                   if not name.startswith(('vision_model.', 'multi_modal_projector.'))}, file,
                  metadata={'format': 'pt'})
    engine = make_engine(str(text_only))
    assert engine.runner.model.vision_model is None
    processor = make_processor(str(text_only))
    assert run(engine, [processor.process(PROMPTS[0])]) == run(make_engine(llama4_vl), prompts[:1])
    image_prompt = processor.process(PROMPTS[1])
    with pytest.raises(ValueError, match='holds no vision tower'):
        engine.add_request(image_prompt.input_ids, multimodal=image_prompt.multimodal)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_checkpoint_missing_part_of_the_tower_is_refused(llama4_vl, tmp_path):
    broken = shutil.copytree(llama4_vl, tmp_path / 'broken')
    for file in broken.glob('*.safetensors'):
        tensors = load_file(file)
        del tensors['vision_model.class_embedding']
        save_file(tensors, file, metadata={'format': 'pt'})
    with pytest.raises(ValueError, match='weights are missing for .*vision_model.class_embedding'):
        make_engine(str(broken))


def test_resize_to_max_canvas_is_refused(llama4_vl, tmp_path):
    path = shutil.copytree(llama4_vl, tmp_path / 'max_canvas')
    (path / 'preprocessor_config.json').write_text(json.dumps(PREPROCESSOR | {'resize_to_max_canvas': True}))
    with pytest.raises(ValueError, match='resize_to_max_canvas are not supported'):
        make_processor(str(path))


def test_a_tokenizer_without_the_image_tokens_is_refused(llama4_vl):
    with pytest.raises(ValueError, match=r"lacks the Llama 4 image tokens \['<\|image\|>'"):
        Llama4ImageInputs(llama4_vl, AutoConfig.from_pretrained(llama4_vl), build_tokenizer())


def test_rotary_angles_are_transformers_at_scouts_size():
    """Scout's tower: 24 x 24 patches and the class token, heads of 88 features (22 pairs turn by column, 22 by row)."""
    vision = Llama4VisionConfig(hidden_size=1408, image_size=336, intermediate_size=5632, num_attention_heads=16,
                                patch_size=14, rope_theta=10000)
    angles = patch_rotary_angles(vision)
    assert angles.shape == (577, 44)
    expected = Llama4VisionRotaryEmbedding(vision).freqs_ci.squeeze(1)
    torch.testing.assert_close(torch.polar(torch.ones_like(angles), angles), expected, rtol=0, atol=1e-6)


def test_model_is_built_as_the_config_says(llama4_vl):
    model = make_engine(llama4_vl).runner.model
    assert isinstance(model, Llama4ForConditionalGeneration)
    assert model.tokens_per_tile == 4
    assert [layer.self_attn.attn.attention_chunk for layer in model.layers] == [8, 8, None, 8]
    assert len(model.vision_model.model.layers) == 2


def test_tp2_equals_tp1(llama4_vl, prompts):
    """Two ranks (gloo on the CPU): the language model sharded, the vision tower whole on each."""
    assert_tp2_equals_tp1(llama4_vl, prompts)


@pytest.fixture
def llama4_vl_server(llama4_vl):
    yield from serve(tiny_engine(llama4_vl), model_name='tiny-vl')


def test_server_chat_with_a_data_url_image_matches_transformers(llama4_vl_server, hf_model):
    assert_image_chat_matches_transformers(llama4_vl_server, hf_model, hf_inputs, IMAGES[2])
