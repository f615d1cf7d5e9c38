"""Qwen3-VL and Qwen3-VL-MoE from llama.cpp's files: a ``qwen3vl`` or ``qwen3vlmoe`` language model (which
decides the model) and an mmproj of projector ``qwen3vl_merger``. The mmproj names each deepstack merger by the
tower layer it reads (``v.deepstack.<layer>``), flags those layers in ``clip.vision.is_deepstack_layers`` and
keeps q/k/v fused, as the checkpoints do; its temporal patch (2) and activation (GELU, tanh approximation) are
those of every Qwen3-VL model. The MoE language model's experts are those of a ``qwen3moe`` file (gguf_archs.py).
Qwen3.5 and Qwen3.5-MoE pair a ``qwen35`` or ``qwen35moe`` language model (gguf_qwen3_next.py) with the same
projector, whose tower has no deepstack mergers."""
from __future__ import annotations

import re
from typing import Any

import torch
from gguf import GGUFReader

from .common import TOWER_BLOCK, VisionFamily, float32_tensors, meta, require_vision_keys
from .qwen2 import PATCH_HALVES, conv3d_patch_weight, qwen_vl_config

# the image processor's pixel limits of the hub's Qwen3-VL checkpoints (the mmproj carries none)
QWEN3_PIXELS = {'shortest_edge': 65536, 'longest_edge': 16777216}
_MODELS = {'qwen3vl': ('qwen3_vl', 'Qwen3VLForConditionalGeneration'),
           'qwen3vlmoe': ('qwen3_vl_moe', 'Qwen3VLMoeForConditionalGeneration'),
           'qwen35': ('qwen3_5', 'Qwen3_5ForConditionalGeneration'),
           'qwen35moe': ('qwen3_5_moe', 'Qwen3_5MoeForConditionalGeneration')}
_BLOCK_NAMES = {'attn_qkv': 'attn.qkv', 'attn_out': 'attn.proj', 'ffn_up': 'mlp.linear_fc1',
                'ffn_down': 'mlp.linear_fc2', 'ln1': 'norm1', 'ln2': 'norm2'}
_DEEPSTACK_NAMES = {'fc1': 'linear_fc1', 'fc2': 'linear_fc2', 'norm': 'norm'}
_OTHER_NAMES = {'v.post_ln': 'merger.norm', 'mm.0': 'merger.linear_fc1', 'mm.2': 'merger.linear_fc2',
                'v.patch_embd': 'patch_embed.proj', 'v.position_embd': 'pos_embed'}
_DEEPSTACK = re.compile(r'v\.deepstack\.(\d+)\.(\w+)\.(weight|bias)')
_POSITIONS = 'v.position_embd.weight'


def _deepstack_layers(mmproj: GGUFReader) -> list[int]:
    """The tower layers whose features go into the first text layers (``deepstack_visual_indexes``)."""
    return [layer for layer, flag in enumerate(meta(mmproj, 'clip.vision.is_deepstack_layers') or []) if flag]


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """A ``Qwen3VLConfig`` or ``Qwen3VLMoeConfig`` dict (by the language model's architecture), the tower's
    shape from the mmproj metadata and its position embedding's rows."""
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'projection_dim', 'patch_size', 'spatial_merge_size'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    positions = next((t for t in mmproj.tensors if t.name == _POSITIONS), None)
    if positions is None:
        raise ValueError(f'{source}: mmproj lacks the position embedding {_POSITIONS}')
    arch = meta(reader, 'general.architecture')
    deepstack = _deepstack_layers(mmproj)
    expected = meta(reader, f'{arch}.n_deepstack_layers')
    if expected is not None and expected != len(deepstack):
        raise ValueError(f'{source}: the mmproj feeds {len(deepstack)} deepstack layers, the language model takes '
                         f'{expected}: the files are of different models')
    vision = {'depth': key('block_count'), 'hidden_size': key('embedding_length'),
              'intermediate_size': key('feed_forward_length'), 'num_heads': key('attention.head_count'),
              'out_hidden_size': key('projection_dim'), 'patch_size': key('patch_size'),
              'spatial_merge_size': key('spatial_merge_size'), 'temporal_patch_size': 2, 'in_channels': 3,
              'num_position_embeddings': int(positions.data.shape[0]), 'deepstack_visual_indexes': deepstack,
              'hidden_act': 'gelu_pytorch_tanh'}
    return qwen_vl_config(text, reader, tokens, source, *_MODELS[arch], vision)


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and projector's float32 tensors under the ``visual.*`` names of Qwen3-VL's checkpoints: the
    deepstack mergers in the order of their tower layers, the two Conv2d halves stacked back into the Conv3d
    patch embedding."""
    raw = float32_tensors(mmproj)
    rank = {layer: index for index, layer in enumerate(_deepstack_layers(mmproj))}
    state_dict = {'visual.patch_embed.proj.weight': conv3d_patch_weight(raw)}
    for name, value in raw.items():
        if name in PATCH_HALVES:
            continue
        block, deepstack = TOWER_BLOCK.fullmatch(name), _DEEPSTACK.fullmatch(name)
        stem, _, kind = name.rpartition('.')
        if block and block[2] in _BLOCK_NAMES:
            state_dict[f'visual.blocks.{block[1]}.{_BLOCK_NAMES[block[2]]}.{block[3]}'] = value
        elif deepstack and deepstack[2] in _DEEPSTACK_NAMES and int(deepstack[1]) in rank:
            merger = f'visual.deepstack_merger_list.{rank[int(deepstack[1])]}'
            state_dict[f'{merger}.{_DEEPSTACK_NAMES[deepstack[2]]}.{deepstack[3]}'] = value
        elif stem in _OTHER_NAMES:
            state_dict[f'visual.{_OTHER_NAMES[stem]}.{kind}'] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """Qwen3-VL's image processor: the mmproj's normalization, patch and merge sizes, the hub's pixel limits."""
    return {'image_processor_type': 'Qwen2VLImageProcessor', 'patch_size': meta(mmproj, 'clip.vision.patch_size'),
            'merge_size': meta(mmproj, 'clip.vision.spatial_merge_size'), 'temporal_patch_size': 2,
            'image_mean': meta(mmproj, 'clip.vision.image_mean'), 'image_std': meta(mmproj, 'clip.vision.image_std'),
            'size': QWEN3_PIXELS}


QWEN3_VL = VisionFamily(tuple(_MODELS), _config, _state_dict, _image_processor)
