"""Gemma 3 with images from llama.cpp's files: a ``gemma3`` language model and an mmproj of projector ``gemma3``
(convert_hf_to_gguf.py ``--mmproj``), served as transformers' ``Gemma3ForConditionalGeneration``. The converter
drops the SigLIP tower's unused attention-pooling head, keeps the input projection as the checkpoint holds it
(``[vision width, text width]``, in float16) and stores the soft-embedding norm as ``1 + weight``; each image's
patches are average-pooled by ``clip.vision.projector.scale_factor`` (llama.cpp's 4 where absent: 256 tokens for
896 px images of 14 px patches)."""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader

from .common import VisionFamily, float32_tensors, meta, require_vision_keys, siglip_tower_name

GEMMA3_IMAGE_TOKENS = ('<image_soft_token>', '<start_of_image>', '<end_of_image>')  # placeholder, span's ends
DEFAULT_SCALE_FACTOR = 4  # llama.cpp's pooling step where the mmproj states none
_TOWER = 'vision_tower.'
_INPUT_PROJECTION = 'mm.input_projection.weight'
_SOFT_EMB_NORM = 'mm.soft_emb_norm.weight'
_PROJECTOR = {_INPUT_PROJECTION: 'multi_modal_projector.mm_input_projection_weight',
              _SOFT_EMB_NORM: 'multi_modal_projector.mm_soft_emb_norm.weight'}


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """A ``Gemma3Config`` dict: ``text`` (the language model's config from its GGUF) as its text config, a SigLIP
    tower without its head, ``mm_tokens_per_image`` from the pooling step and the image tokens' ids."""
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'image_size', 'patch_size'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in mmproj.tensors}
    if _INPUT_PROJECTION not in shapes or _SOFT_EMB_NORM not in shapes:
        raise ValueError(f'{source}: the gemma3 mmproj needs {_INPUT_PROJECTION} and {_SOFT_EMB_NORM}')
    width = shapes[_INPUT_PROJECTION][-1]
    if width != text['hidden_size']:
        raise ValueError(f'{source}: the projector gives {width} features, the language model takes '
                         f'{text["hidden_size"]}: the mmproj is another model\'s')
    missing = [token for token in GEMMA3_IMAGE_TOKENS if token not in tokens]
    if missing:
        raise ValueError(f'{source}: the tokenizer has no {", ".join(missing)} token (Gemma 3\'s image tokens)')
    vision = {'model_type': 'siglip_vision_model', 'hidden_size': key('embedding_length'),
              'intermediate_size': key('feed_forward_length'), 'num_hidden_layers': key('block_count'),
              'num_attention_heads': key('attention.head_count'), 'image_size': key('image_size'),
              'patch_size': key('patch_size'), 'layer_norm_eps': key('attention.layer_norm_epsilon') or 1e-6,
              'hidden_act': 'gelu_pytorch_tanh', 'vision_use_head': False}
    scale = key('projector.scale_factor') or DEFAULT_SCALE_FACTOR
    side = vision['image_size'] // vision['patch_size']
    if side % scale:
        raise ValueError(f'{source}: {side} x {side} patches do not pool by clip.vision.projector.scale_factor '
                         f'{scale}')
    text_config = {k: v for k, v in text.items() if k != 'architectures'}
    image, boi, eoi = (tokens.index(token) for token in GEMMA3_IMAGE_TOKENS)
    return {'model_type': 'gemma3', 'architectures': ['Gemma3ForConditionalGeneration'], 'text_config': text_config,
            'vision_config': vision, 'mm_tokens_per_image': (side // scale)**2, 'image_token_index': image,
            'boi_token_index': boi, 'eoi_token_index': eoi, 'tie_word_embeddings': text['tie_word_embeddings'],
            'bos_token_id': text['bos_token_id'], 'eos_token_id': text['eos_token_id'], 'dtype': 'float32'}


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and projector's float32 tensors under the names of transformers' Gemma 3 checkpoints, the
    soft-embedding norm's weight back to Gemma's ``weight`` (the file holds ``1 + weight``)."""
    state_dict = {}
    for name, value in float32_tensors(mmproj).items():
        tower_name = siglip_tower_name(name, _TOWER)
        if tower_name:
            state_dict[tower_name] = value
        elif name in _PROJECTOR:
            state_dict[_PROJECTOR[name]] = value - 1 if name == _SOFT_EMB_NORM else value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """Gemma 3's image processor as its checkpoints have it (resized to the tower's square, bilinear, no
    pan-and-scan) with the mmproj's size and normalization."""
    size = meta(mmproj, 'clip.vision.image_size')
    return {'image_processor_type': 'Gemma3ImageProcessor', 'size': {'height': size, 'width': size},
            'do_resize': True, 'resample': 2, 'do_rescale': True, 'rescale_factor': 1 / 255, 'do_normalize': True,
            'do_convert_rgb': True, 'do_pan_and_scan': False, 'image_mean': meta(mmproj, 'clip.vision.image_mean'),
            'image_std': meta(mmproj, 'clip.vision.image_std')}


GEMMA3 = VisionFamily(('gemma3',), _config, _state_dict, _image_processor)
