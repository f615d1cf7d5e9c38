"""Llama 4 with images from llama.cpp's files: a ``llama4`` language model and an mmproj of projector ``llama4``
(convert_hf_to_gguf.py ``--mmproj`` of a ``Llama4ForConditionalGeneration``), served as transformers'
``Llama4ForConditionalGeneration``.

The converter keeps every tensor of the tower and projector, renamed: the vision adapter's MLP as
``mm.model.mlp.{1,2}``, the projector's ``linear_1`` as ``mm.model.fc``. gguf-py's tensor map names a block's
post-attention LayerNorm ``attn_post_norm`` since it learned Gemma 4's tower (whose name shadows Llama 4's); files
converted before that name it ``ln2``: both are read. The pixel shuffle is stored as
``clip.vision.projector.scale_factor`` (``1 / pixel_shuffle_ratio``); the adapter's and projector's widths are the
tensors' shapes. Not stored, and taken as transformers' ``Llama4VisionConfig`` defaults (llama.cpp fixes the same
rope base): the tower's rope base 10000, 3 channels; the tiling is Llama 4's image processor's default (up to 16
tiles of ``clip.vision.image_size``, bilinear) with the file's mean and std.
"""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader

from .common import TOWER_BLOCK, VisionFamily, float32_tensors, meta, require_vision_keys

# the placeholder, the span's ends, the global tile's marker and the tile separators
IMAGE_TOKENS = ('<|patch|>', '<|image_start|>', '<|image_end|>', '<|image|>', '<|tile_x_separator|>',
                '<|tile_y_separator|>')
VISION_ROPE_THETA = 10000.0
MAX_TILES = 16  # Llama4ImageProcessor's max_patches
_TOWER = 'vision_model.'
_BLOCK_NAMES = {'attn_q': 'self_attn.q_proj', 'attn_k': 'self_attn.k_proj', 'attn_v': 'self_attn.v_proj',
                'attn_out': 'self_attn.o_proj', 'ln1': 'input_layernorm', 'ln2': 'post_attention_layernorm',
                'attn_post_norm': 'post_attention_layernorm', 'ffn_up': 'mlp.fc1', 'ffn_down': 'mlp.fc2'}
_ADAPTER_IN, _ADAPTER_OUT, _PROJECTOR = 'mm.model.mlp.1.weight', 'mm.model.mlp.2.weight', 'mm.model.fc.weight'
_NAMES = {'v.class_embd': f'{_TOWER}class_embedding', 'v.position_embd.weight': f'{_TOWER}positional_embedding_vlm',
          'v.patch_embd.weight': f'{_TOWER}patch_embedding.linear.weight',
          'v.pre_ln.weight': f'{_TOWER}layernorm_pre.weight', 'v.pre_ln.bias': f'{_TOWER}layernorm_pre.bias',
          'v.post_ln.weight': f'{_TOWER}layernorm_post.weight', 'v.post_ln.bias': f'{_TOWER}layernorm_post.bias',
          _ADAPTER_IN: f'{_TOWER}vision_adapter.mlp.fc1.weight', _ADAPTER_OUT: f'{_TOWER}vision_adapter.mlp.fc2.weight',
          _PROJECTOR: 'multi_modal_projector.linear_1.weight'}


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """A ``Llama4Config`` dict: ``text`` (the language model's config from its GGUF) as its text config, a tower of
    the mmproj's shape, the adapter's and projector's widths from their tensors and the image tokens' ids."""
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'image_size', 'patch_size', 'projector.scale_factor'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in mmproj.tensors}
    missing = [name for name in (_ADAPTER_IN, _ADAPTER_OUT, _PROJECTOR) if name not in shapes]
    if missing:
        raise ValueError(f'{source}: the llama4 mmproj has no {", ".join(missing)} (Llama 4\'s adapter and projector)')
    (adapter_width, shuffled), (adapter_out, adapter_out_in) = shapes[_ADAPTER_IN], shapes[_ADAPTER_OUT]
    projector_out, projector_in = shapes[_PROJECTOR]
    width, scale = key('embedding_length'), key('projector.scale_factor')
    if projector_out != text['hidden_size']:
        raise ValueError(f'{source}: the projector gives {projector_out} features, the language model takes '
                         f'{text["hidden_size"]}: the mmproj is another model\'s')
    if shuffled != width * scale**2 or adapter_out_in != adapter_width or projector_in != adapter_out:
        raise ValueError(f'{source}: the adapter and projector do not chain: {width} features pixel-shuffled by '
                         f'{scale} x {scale}, {_ADAPTER_IN} {list(shapes[_ADAPTER_IN])}, {_ADAPTER_OUT} '
                         f'{list(shapes[_ADAPTER_OUT])}, {_PROJECTOR} {list(shapes[_PROJECTOR])}')
    missing = [token for token in IMAGE_TOKENS if token not in tokens]
    if missing:
        raise ValueError(f'{source}: the tokenizer has no {", ".join(missing)} token (Llama 4\'s image tokens)')
    vision = {'model_type': 'llama4_vision_model', 'hidden_size': width,
              'intermediate_size': key('feed_forward_length'), 'num_hidden_layers': key('block_count'),
              'num_attention_heads': key('attention.head_count'),
              'image_size': key('image_size'), 'patch_size': key('patch_size'), 'num_channels': 3,
              'norm_eps': key('attention.layer_norm_epsilon') or 1e-5, 'hidden_act': 'gelu',
              'pixel_shuffle_ratio': 1 / scale, 'projector_input_dim': adapter_width,
              'projector_output_dim': adapter_out, 'vision_output_dim': adapter_out,
              'rope_parameters': {'rope_type': 'default', 'rope_theta': VISION_ROPE_THETA}}
    text_config = {k: v for k, v in text.items() if k != 'architectures'}
    patch, start, end = (tokens.index(token) for token in IMAGE_TOKENS[:3])
    return {'model_type': 'llama4', 'architectures': ['Llama4ForConditionalGeneration'], 'text_config': text_config,
            'vision_config': vision, 'image_token_index': patch, 'boi_token_index': start, 'eoi_token_index': end,
            'tie_word_embeddings': text['tie_word_embeddings'], 'dtype': 'float32'}


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's, adapter's and projector's float32 tensors under the names of the hub's Llama 4 checkpoints."""
    state_dict = {}
    for name, value in float32_tensors(mmproj).items():
        block = TOWER_BLOCK.fullmatch(name)
        if block and block[2] in _BLOCK_NAMES:
            state_dict[f'{_TOWER}model.layers.{block[1]}.{_BLOCK_NAMES[block[2]]}.{block[3]}'] = value
        elif name in _NAMES:
            state_dict[_NAMES[name]] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """Llama 4's image processor as the hub's checkpoints have it (up to 16 tiles, bilinear, not upscaled to the
    largest canvas) with the mmproj's tile size and normalization."""
    size = meta(mmproj, 'clip.vision.image_size')
    return {'image_processor_type': 'Llama4ImageProcessorFast', 'size': {'height': size, 'width': size},
            'max_patches': MAX_TILES, 'resize_to_max_canvas': False, 'resample': 2, 'do_resize': True,
            'do_rescale': True, 'rescale_factor': 1 / 255, 'do_normalize': True, 'do_convert_rgb': True,
            'image_mean': meta(mmproj, 'clip.vision.image_mean'), 'image_std': meta(mmproj, 'clip.vision.image_std')}


LLAMA4 = VisionFamily(('llama4',), _config, _state_dict, _image_processor)
