"""SmolVLM and Idefics3 from llama.cpp's files: a ``llama`` language model and an mmproj of projector ``idefics3``
(convert_hf_to_gguf.py ``--mmproj`` on a ``SmolVLMForConditionalGeneration`` or ``Idefics3ForConditionalGeneration``),
served as transformers' ``Idefics3ForConditionalGeneration`` (SmolVLM's math under Idefics3's names). The mmproj
holds the tower under gguf-py's names and the connector's projection as ``mm.model.fc.weight``; its metadata the pixel
shuffle (``clip.vision.projector.scale_factor``) and the longest side images are resized to
(``clip.vision.preproc_image_size``; files without it: 4 tiles, transformers' default ratio)."""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader

from .common import VisionFamily, float32_tensors, meta, require_vision_keys, siglip_tower_name

IMAGE_TOKENS = ('<image>', '<fake_token_around_image>', '<global-img>')  # the placeholder, then the span's markers
DEFAULT_SCALE_FACTOR = 2  # the converter's where the checkpoint names none
TILES_PER_SIDE = 4  # transformers' ratio of `size` to `max_image_size` where the file names no preprocessing size
_PROJECTION = 'mm.model.fc.weight'
_TOWER = 'vision_model.'


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """An ``Idefics3Config`` dict: ``text`` (the language model's config from its GGUF) as its text config, the tower
    the mmproj describes, its pixel shuffle and the ``<image>`` token's id."""
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'image_size', 'patch_size'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    scale = key('projector.scale_factor') or DEFAULT_SCALE_FACTOR
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in mmproj.tensors}
    if _PROJECTION not in shapes:
        raise ValueError(f'{source}: the idefics3 mmproj needs {_PROJECTION} (the connector\'s projection)')
    expected = (text['hidden_size'], key('embedding_length') * scale**2)
    if shapes[_PROJECTION] != expected:
        raise ValueError(f'{source}: the connector\'s projection is {list(shapes[_PROJECTION])}, a tower of '
                         f'{key("embedding_length")} features shuffled by {scale} into a language model of '
                         f'{text["hidden_size"]} takes {list(expected)}: the mmproj is another model\'s')
    missing = [token for token in IMAGE_TOKENS if token not in tokens]
    if missing:
        raise ValueError(f'{source}: the tokenizer has no {", ".join(missing)} token (SmolVLM\'s image tokens)')
    vision = {'model_type': 'idefics3_vision', 'hidden_size': key('embedding_length'),
              'intermediate_size': key('feed_forward_length'), 'num_hidden_layers': key('block_count'),
              'num_attention_heads': key('attention.head_count'), 'image_size': key('image_size'),
              'patch_size': key('patch_size'), 'layer_norm_eps': key('attention.layer_norm_epsilon') or 1e-6,
              'hidden_act': 'gelu_pytorch_tanh'}
    side = vision['image_size'] // vision['patch_size']
    if side % scale:
        raise ValueError(f'{source}: {side} x {side} patches do not shuffle by clip.vision.projector.scale_factor '
                         f'{scale}')
    text_config = {k: v for k, v in text.items() if k != 'architectures'}
    return {'model_type': 'idefics3', 'architectures': ['Idefics3ForConditionalGeneration'],
            'text_config': text_config, 'vision_config': vision, 'scale_factor': scale,
            'image_token_id': tokens.index(IMAGE_TOKENS[0]), 'tie_word_embeddings': text['tie_word_embeddings'],
            'bos_token_id': text['bos_token_id'], 'eos_token_id': text['eos_token_id'], 'dtype': 'float32'}


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and connector's float32 tensors under the names of transformers' Idefics3 checkpoints."""
    state_dict = {}
    for name, value in float32_tensors(mmproj).items():
        tower_name = siglip_tower_name(name, _TOWER)
        if tower_name:
            state_dict[tower_name] = value
        elif name == _PROJECTION:
            state_dict['connector.modality_projection.proj.weight'] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """The image processor of SmolVLM's checkpoints (Lanczos, images split into tiles of the tower's size plus a
    global one) with the mmproj's sizes and normalization."""
    tile = meta(mmproj, 'clip.vision.image_size')
    longest = meta(mmproj, 'clip.vision.preproc_image_size') or TILES_PER_SIDE * tile
    return {'image_processor_type': 'Idefics3ImageProcessor', 'size': {'longest_edge': longest},
            'max_image_size': {'longest_edge': tile}, 'do_resize': True, 'resample': 1, 'do_rescale': True,
            'rescale_factor': 1 / 255, 'do_normalize': True, 'do_convert_rgb': True, 'do_image_splitting': True,
            'do_pad': True, 'image_mean': meta(mmproj, 'clip.vision.image_mean'),
            'image_std': meta(mmproj, 'clip.vision.image_std')}


IDEFICS3 = VisionFamily(('llama', ), _config, _state_dict, _image_processor)
