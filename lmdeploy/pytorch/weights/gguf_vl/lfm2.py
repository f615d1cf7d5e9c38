"""LFM2-VL from llama.cpp's files: an ``lfm2`` language model and an mmproj of projector ``lfm2`` (convert_hf_to_gguf.py
``--mmproj`` on an ``Lfm2VlForConditionalGeneration``), served as transformers' ``Lfm2VlForConditionalGeneration``.
The converter keeps the SigLIP2 tower's layers up to ``vision_feature_layer`` (``clip.vision.block_count``), writes its
linear patch embedding as a convolution's ``[width, 3, patch, patch]`` and the projector as ``mm.input_norm``,
``mm.1``, ``mm.2``; the unshuffle factor is ``clip.vision.projector.scale_factor``. The files hold no tiling settings:
images are tiled with transformers' ``Lfm2VlImageProcessor`` defaults, those of the released checkpoints."""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader

from .common import VisionFamily, float32_tensors, meta, require_vision_keys, siglip_tower_name

LFM2_IMAGE_TOKEN = '<image>'
_TOWER = 'vision_tower.'
_PROJECTOR = {'mm.input_norm.weight': 'multi_modal_projector.layer_norm.weight',
              'mm.input_norm.bias': 'multi_modal_projector.layer_norm.bias',
              'mm.1.weight': 'multi_modal_projector.linear_1.weight',
              'mm.1.bias': 'multi_modal_projector.linear_1.bias',
              'mm.2.weight': 'multi_modal_projector.linear_2.weight',
              'mm.2.bias': 'multi_modal_projector.linear_2.bias'}
_PATCH_EMBEDDING = 'v.patch_embd.weight'


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """An ``Lfm2VlConfig`` dict: ``text`` (the language model's config from its GGUF) as its text config, a SigLIP2
    tower of the mmproj's kept layers (no head), the projector's widths and the ``<image>`` token's id."""
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'patch_size'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in mmproj.tensors}
    missing = [name for name in ('mm.1.weight', 'mm.2.weight', 'v.position_embd.weight') if name not in shapes]
    if missing:
        raise ValueError(f'{source}: the lfm2 mmproj needs {", ".join(missing)}')
    if shapes['mm.2.weight'][0] != text['hidden_size']:
        raise ValueError(f'{source}: the projector gives {shapes["mm.2.weight"][0]} features, the language model '
                         f'takes {text["hidden_size"]}: the mmproj is another model\'s')
    if LFM2_IMAGE_TOKEN not in tokens:
        raise ValueError(f'{source}: the tokenizer has no {LFM2_IMAGE_TOKEN} token (LFM2-VL\'s image token)')
    vision = {'model_type': 'siglip2_vision_model', 'hidden_size': key('embedding_length'),
              'intermediate_size': key('feed_forward_length'), 'num_hidden_layers': key('block_count'),
              'num_attention_heads': key('attention.head_count'), 'patch_size': key('patch_size'),
              'num_patches': shapes['v.position_embd.weight'][0],
              'layer_norm_eps': key('attention.layer_norm_epsilon') or 1e-6, 'hidden_act': 'gelu_pytorch_tanh',
              'vision_use_head': False}
    text_config = {k: v for k, v in text.items() if k != 'architectures'}
    return {'model_type': 'lfm2_vl', 'architectures': ['Lfm2VlForConditionalGeneration'], 'text_config': text_config,
            'vision_config': vision, 'image_token_id': tokens.index(LFM2_IMAGE_TOKEN),
            'downsample_factor': key('projector.scale_factor') or 2,
            'projector_hidden_size': shapes['mm.1.weight'][0], 'projector_hidden_act': 'gelu',
            'projector_bias': 'mm.1.bias' in shapes, 'projector_use_layernorm': 'mm.input_norm.weight' in shapes,
            'tie_word_embeddings': text['tie_word_embeddings'], 'dtype': 'float32'}


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and projector's float32 tensors under the names of transformers' LFM2-VL checkpoints, the patch
    embedding back to a linear layer over each patch's ``(row, column, channel)`` values."""
    state_dict = {}
    for name, value in float32_tensors(mmproj).items():
        if name == _PATCH_EMBEDDING:
            state_dict[_TOWER + 'embeddings.patch_embedding.weight'] = value.permute(0, 2, 3, 1).reshape(
                value.shape[0], -1)
        elif siglip_tower_name(name, _TOWER):
            state_dict[siglip_tower_name(name, _TOWER)] = value
        elif name in _PROJECTOR:
            state_dict[_PROJECTOR[name]] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """transformers' ``Lfm2VlImageProcessor`` defaults with the mmproj's patch size, unshuffle factor and
    normalization."""
    return {'image_processor_type': 'Lfm2VlImageProcessor',
            'encoder_patch_size': meta(mmproj, 'clip.vision.patch_size'),
            'downsample_factor': meta(mmproj, 'clip.vision.projector.scale_factor') or 2,
            'image_mean': meta(mmproj, 'clip.vision.image_mean'), 'image_std': meta(mmproj, 'clip.vision.image_std')}


LFM2_VL = VisionFamily(('lfm2',), _config, _state_dict, _image_processor)
