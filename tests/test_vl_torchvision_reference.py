"""lmdeploy's image preprocessing against what a transformers user with torchvision gets: each family's
``AutoProcessor`` (its image processor on the torchvision backend), run in a subprocess with a torchvision wheel
unpacked into ``.ci/torchvision`` (``.ci/run`` puts it there). Checkpoints hold only what preprocessing reads, with
the released checkpoints' preprocessing settings (tile and patch sizes, pixel limits, resampling, mean and std);
images of many sizes and aspect ratios, tiny, large and extreme, RGBA with transparency, grayscale and a palette.
Each prompt's token ids (the image-token expansion), pixels and image metadata are compared."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import build_tokenizer
from PIL import Image
from test_vl_families import make_processor
from glm4v_models import GLM_IMAGE
from glm4v_models import IMAGE_TOKENS as GLM4V_TOKENS
from transformers import (Gemma3Config, Glm4vConfig, InternVLConfig, Llama4Config, LlavaConfig, Mistral3Config,
                          Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3_5Config, Qwen3VLConfig)
from transformers.models.llama4.processing_llama4 import chat_template as LLAMA4_TEMPLATE
from vl_models import (GEMMA3_TOKENS, INTERNVL_IMAGE, INTERNVL_TOKENS, LLAVA_IMAGE, MISTRAL3_TOKENS, QWEN_IMAGE,
                       SPECIAL_TOKENS, image_chat_template, name_image_tokens)

from lmdeploy.vl.processor import ProcessedPrompt

TESTS = os.path.dirname(os.path.abspath(__file__))
TORCHVISION = os.path.join(os.path.dirname(TESTS), '.ci', 'torchvision')
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
HALF = {'image_mean': [0.5] * 3, 'image_std': [0.5] * 3}
QWEN2_VL = {'image_processor_type': 'Qwen2VLImageProcessor', 'min_pixels': 3136, 'max_pixels': 12845056,
            'patch_size': 14, 'temporal_patch_size': 2, 'merge_size': 2, 'image_mean': CLIP_MEAN,
            'image_std': CLIP_STD}
QWEN3_VL = {'image_processor_type': 'Qwen2VLImageProcessorFast', 'size': {'longest_edge': 16777216,
                                                                          'shortest_edge': 65536},
            'patch_size': 16, 'temporal_patch_size': 2, 'merge_size': 2, **HALF}
LLAMA4_TOKENS = ['<|image|>', '<|image_start|>', '<|image_end|>', '<|patch|>', '<|tile_x_separator|>',
                 '<|tile_y_separator|>', '<|header_start|>', '<|header_end|>', '<|eot|>']
# family: (preprocessor_config.json, processor_config.json) as the released checkpoints hold them, but for smaller
# tensors: InternVL's tiles of 224 px, up to 4 (448 px, up to 12 released), and Gemma 3's 448 px image (896 px)
SETTINGS = {
    'qwen2_vl': (QWEN2_VL, {'processor_class': 'Qwen2VLProcessor'}),
    'qwen2_5_vl': (QWEN2_VL, {'processor_class': 'Qwen2_5_VLProcessor'}),
    'qwen3_vl': (QWEN3_VL, {'processor_class': 'Qwen3VLProcessor'}),
    'qwen3_5': (QWEN3_VL, {'processor_class': 'Qwen3VLProcessor'}),
    'internvl': ({'image_processor_type': 'GotOcr2ImageProcessorFast', 'size': {'height': 224, 'width': 224},
                  'crop_to_patches': False, 'max_patches': 4, 'min_patches': 1, 'resample': 3,
                  'image_mean': [0.485, 0.456, 0.406], 'image_std': [0.229, 0.224, 0.225]},
                 {'processor_class': 'InternVLProcessor', 'image_seq_length': 64}),
    'llava': ({'image_processor_type': 'CLIPImageProcessor', 'size': {'shortest_edge': 336},
               'crop_size': {'height': 336, 'width': 336}, 'do_center_crop': True, 'resample': 3,
               'image_mean': CLIP_MEAN, 'image_std': CLIP_STD},
              {'processor_class': 'LlavaProcessor', 'patch_size': 14, 'vision_feature_select_strategy': 'default',
               'num_additional_image_tokens': 1}),
    'mistral3': ({'image_processor_type': 'PixtralImageProcessorFast', 'size': {'longest_edge': 1540},
                  'patch_size': 14, 'resample': 3, 'image_mean': CLIP_MEAN, 'image_std': CLIP_STD},
                 {'processor_class': 'PixtralProcessor', 'patch_size': 14, 'spatial_merge_size': 2}),
    'gemma3': ({'image_processor_type': 'Gemma3ImageProcessor', 'size': {'height': 448, 'width': 448},
                'resample': 2, **HALF}, {'processor_class': 'Gemma3Processor', 'image_seq_length': 256}),
    'llama4': ({'image_processor_type': 'Llama4ImageProcessorFast', 'size': {'height': 336, 'width': 336},
                'max_patches': 16, 'resample': 2, 'resize_to_max_canvas': False, **HALF},
               {'processor_class': 'Llama4Processor', 'patch_size': 14}),
    'glm4v': ({'image_processor_type': 'Glm4vImageProcessor', 'size': {'shortest_edge': 12544,
                                                                       'longest_edge': 9633792},
               'patch_size': 14, 'temporal_patch_size': 2, 'merge_size': 2, 'resample': 3, 'image_mean': CLIP_MEAN,
               'image_std': CLIP_STD}, {'processor_class': 'Glm4vProcessor'}),
}


def _config(family: str, ids: dict[str, int]):
    """The family's config with the released checkpoints' vision geometry (the widths do not matter here)."""
    qwen = dict(image_token_id=ids.get('<|image_pad|>'), video_token_id=ids.get('<|video_pad|>'),
                vision_start_token_id=ids.get('<|vision_start|>'), vision_end_token_id=ids.get('<|vision_end|>'))
    if family in ('qwen2_vl', 'qwen2_5_vl'):
        config = Qwen2VLConfig if family == 'qwen2_vl' else Qwen2_5_VLConfig
        return config(vision_config={'patch_size': 14, 'spatial_merge_size': 2}, **qwen)
    if family in ('qwen3_vl', 'qwen3_5'):
        config = Qwen3VLConfig if family == 'qwen3_vl' else Qwen3_5Config
        return config(vision_config={'patch_size': 16, 'spatial_merge_size': 2}, **qwen)
    if family == 'internvl':
        return InternVLConfig(vision_config={'image_size': 224, 'patch_size': 14}, downsample_ratio=0.5,
                              image_token_id=ids['<IMG_CONTEXT>'])
    if family == 'llava':
        return LlavaConfig(vision_config={'model_type': 'clip_vision_model', 'image_size': 336, 'patch_size': 14},
                           image_token_id=ids['<image>'], vision_feature_select_strategy='default')
    if family == 'mistral3':
        return Mistral3Config(vision_config={'model_type': 'pixtral', 'patch_size': 14, 'image_size': 1540},
                              spatial_merge_size=2, image_token_id=ids['[IMG]'])
    if family == 'gemma3':
        return Gemma3Config(mm_tokens_per_image=256, image_token_index=ids['<image_soft_token>'],
                            boi_token_index=ids['<start_of_image>'], eoi_token_index=ids['<end_of_image>'])
    if family == 'glm4v':
        return Glm4vConfig(vision_config={'patch_size': 14, 'spatial_merge_size': 2},
                           image_token_id=ids['<|image|>'], video_token_id=ids['<|video|>'],
                           image_start_token_id=ids['<|begin_of_image|>'],
                           image_end_token_id=ids['<|end_of_image|>'])
    return Llama4Config(vision_config={'patch_size': 14, 'image_size': 336, 'pixel_shuffle_ratio': 0.5},
                        image_token_index=ids['<|patch|>'])


def save_processor_checkpoint(family: str, path: str) -> str:
    """Config, tokenizer (with an image-aware chat template) and the processor settings of ``family`` in ``path``;
    no weights."""
    tokenizer = build_tokenizer()
    named = {'internvl': INTERNVL_TOKENS, 'gemma3': GEMMA3_TOKENS}.get(family)
    special = (list(named.values()) if named else MISTRAL3_TOKENS if family == 'mistral3'
               else LLAMA4_TOKENS if family == 'llama4' else GLM4V_TOKENS if family == 'glm4v' else SPECIAL_TOKENS)
    tokenizer.add_special_tokens({'additional_special_tokens': special})
    image = {'internvl': INTERNVL_IMAGE, 'llava': LLAVA_IMAGE, 'mistral3': MISTRAL3_TOKENS[0],
             'gemma3': GEMMA3_TOKENS['boi_token'], 'glm4v': GLM_IMAGE}.get(family, QWEN_IMAGE)
    tokenizer.chat_template = LLAMA4_TEMPLATE if family == 'llama4' else image_chat_template(image)
    _config(family, {token: tokenizer.convert_tokens_to_ids(token) for token in special}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if named:
        name_image_tokens(path, named)
    preprocessor, processor = SETTINGS[family]
    for name, settings in (('preprocessor_config.json', preprocessor), ('processor_config.json', processor)):
        with open(os.path.join(path, name), 'w') as f:
            json.dump(settings, f)
    return path


def _picture(seed: int, width: int, height: int, mode: str = 'RGB') -> Image.Image:
    """Smooth colour gradients with noise on top (resampling differences show on both), in ``mode``."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), (x + y) / max(width + height - 2, 1)], -1)
    pixels = np.clip(base * 200 + rng.randint(0, 56, (height, width, 3)), 0, 255).astype(np.uint8)
    if mode == 'RGBA':  # transparent, half and fully opaque pixels
        alpha = rng.choice(np.array([0, 128, 255], dtype=np.uint8), (height, width, 1))
        return Image.fromarray(np.concatenate([pixels, alpha], -1), 'RGBA')
    image = Image.fromarray(pixels)
    if mode == 'P':  # a palette whose first colour is transparent, and pixels of that colour
        quantized = image.quantize(16)
        indices = np.asarray(quantized).copy()
        indices.flat[::7] = 0
        image = Image.fromarray(indices, 'P')
        image.putpalette(quantized.getpalette())
        image.info['transparency'] = 0
        return image
    return image.convert(mode)


# upscaled and downscaled by each family, cut into one tile and into many
IMAGES = {'tiny': _picture(1, 20, 13), 'small': _picture(2, 90, 60), 'large': _picture(3, 640, 480),
          'wide': _picture(4, 800, 50), 'tall': _picture(5, 45, 700), 'rgba': _picture(6, 120, 80, 'RGBA'),
          'gray': _picture(7, 150, 110, 'L'), 'palette': _picture(8, 64, 48, 'P')}
FAMILIES = list(SETTINGS)
# Qwen2.5-VL's and Qwen3.5's image processors are Qwen2-VL's and Qwen3-VL's, with the same settings: two images
# check their processors' token expansion
IMAGE_NAMES = {family: ['tiny', 'wide'] if family in ('qwen2_5_vl', 'qwen3_5') else list(IMAGES) for family in FAMILIES}


def reference_outputs(jobs: list[dict], workdir: str) -> list[dict[str, torch.Tensor]]:
    """The torchvision-backed processors' outputs for ``jobs``, from a subprocess."""
    jobs_path, out_path = os.path.join(workdir, 'jobs.json'), os.path.join(workdir, 'reference.pt')
    with open(jobs_path, 'w') as f:
        json.dump(jobs, f)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TORCHVISION, os.environ.get('PYTHONPATH', '')]))
    subprocess.run([sys.executable, os.path.join(TESTS, 'torchvision_reference.py'), jobs_path, out_path],
                   env=env, check=True, timeout=300)
    return torch.load(out_path)


@pytest.fixture(scope='module')
def compared(tmp_path_factory) -> dict[str, list[tuple[ProcessedPrompt, dict[str, torch.Tensor]]]]:
    """Per family and image: lmdeploy's processed prompt, and the reference processor's outputs on the same
    rendered text and image file."""
    if not os.path.isdir(TORCHVISION):
        pytest.skip(f'no torchvision wheel in {TORCHVISION} (python -m pip install --no-deps --target '
                    f'.ci/torchvision torchvision==0.28.0, as .ci/run does)')
    workdir = str(tmp_path_factory.mktemp('torchvision_reference'))
    paths = {name: os.path.join(workdir, f'{name}.png') for name in IMAGES}
    for name, image in IMAGES.items():
        image.save(paths[name])
    processed, jobs = [], []
    for family in FAMILIES:
        checkpoint = save_processor_checkpoint(family, os.path.join(workdir, family))
        processor = make_processor(checkpoint)
        for name in IMAGE_NAMES[family]:
            prompt = ('describe', Image.open(paths[name]))
            processed.append((family, processor.process(prompt)))
            jobs.append({'checkpoint': checkpoint, 'text': processor.render(prompt, images=[]),
                         'images': [paths[name]]})
    compared = {family: [] for family in FAMILIES}
    for (family, prompt), reference in zip(processed, reference_outputs(jobs, workdir)):
        compared[family].append((prompt, reference))
    return compared


@pytest.mark.parametrize('family', FAMILIES)
def test_prompt_pixels_and_metadata_are_those_of_the_torchvision_processor(compared, family):
    """The token ids (the image's expansion), the image metadata (Qwen's grids, Mistral 3's sizes) and the pixels
    equal the processor's: Llama 4's bit for bit (bf16 values), the others' to float32 rounding (transformers fuses
    the rescale into the normalization, lmdeploy's PIL backend does one after the other)."""
    for name, (processed, reference) in zip(IMAGE_NAMES[family], compared[family]):
        assert reference['backend'] == 'torchvision'
        assert processed.input_ids == reference['input_ids'][0].tolist(), name
        data = processed.multimodal[0].data
        assert data['pixel_values'].shape == reference['pixel_values'].shape, name
        difference = (data['pixel_values'] - reference['pixel_values'].float()).abs().max()
        assert difference <= (0 if family == 'llama4' else 1e-6), (name, difference)
        for key in data.keys() & reference.keys() - {'pixel_values'}:  # Llama4Processor keeps its aspect ratios
            assert torch.equal(data[key], reference[key]), (name, key)
