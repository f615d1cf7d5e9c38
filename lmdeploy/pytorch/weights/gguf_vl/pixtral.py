"""Mistral 3 (Mistral Small 3.1 / 3.2, Ministral 3) with images from llama.cpp's files: a ``mistral3`` language model
(older converters wrote Mistral Small's as ``llama``) and an mmproj of projector ``pixtral`` (convert_hf_to_gguf.py
``--mmproj`` of a ``Mistral3ForConditionalGeneration``), served as transformers' ``Mistral3ForConditionalGeneration``.

The converter permutes the tower's q/k rows for llama.cpp's rotary, as it does a Llama language model's (undone
here). From Mistral's own checkpoint format it also copies the ``[IMG_BREAK]`` row of the embeddings into the mmproj
(``v.token_embd.img_break``, which the language model's embeddings hold already) and writes the tower's rope base
(``clip.rope.freq_base``; from transformers' layout it does not: 10000, transformers' and llama.cpp's default). It
writes no feature layer: llama.cpp takes the tower's last layer, so ``vision_feature_layer`` is -1.
"""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader

from ..gguf_archs import unpermute_rotary
from .common import TOWER_BLOCK, VisionFamily, float32_tensors, meta, require_vision_keys

IMAGE_TOKENS = ('[IMG]', '[IMG_BREAK]', '[IMG_END]')  # placeholder, row end, image end
VISION_ROPE_THETA = 10000.0  # the tower's rope base where the mmproj states none
_TOWER = 'vision_tower.'
_BLOCK_NAMES = {'attn_q': 'attention.q_proj', 'attn_k': 'attention.k_proj', 'attn_v': 'attention.v_proj',
                'attn_out': 'attention.o_proj', 'ffn_gate': 'feed_forward.gate_proj',
                'ffn_up': 'feed_forward.up_proj', 'ffn_down': 'feed_forward.down_proj', 'ln1': 'attention_norm',
                'ln2': 'ffn_norm'}
_ROTATED = ('attn_q', 'attn_k')
_NAMES = {'v.patch_embd.weight': f'{_TOWER}patch_conv.weight', 'v.pre_ln.weight': f'{_TOWER}ln_pre.weight',
          'mm.input_norm.weight': 'multi_modal_projector.norm.weight',
          'mm.patch_merger.weight': 'multi_modal_projector.patch_merger.merging_layer.weight',
          'mm.1.weight': 'multi_modal_projector.linear_1.weight', 'mm.1.bias': 'multi_modal_projector.linear_1.bias',
          'mm.2.weight': 'multi_modal_projector.linear_2.weight', 'mm.2.bias': 'multi_modal_projector.linear_2.bias'}
_IMG_BREAK_EMBEDDING = 'v.token_embd.img_break'
_PROJECTOR = ('mm.input_norm.weight', 'mm.patch_merger.weight', 'mm.1.weight', 'mm.2.weight')


def _hidden_act(mmproj: GGUFReader, source: str) -> str:
    if meta(mmproj, 'clip.use_silu'):
        return 'silu'
    if meta(mmproj, 'clip.use_gelu'):
        return 'gelu'
    raise ValueError(f'{source}: the pixtral mmproj names no activation of its tower (clip.use_silu or clip.use_gelu)')


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """A ``Mistral3Config`` dict: ``text`` (the language model's config from its GGUF; a ``llama`` file's is taken
    as Mistral's) as its text config, a Pixtral tower of the mmproj's shape, its patch merger's
    ``clip.vision.spatial_merge_size`` and the image tokens' ids."""
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in mmproj.tensors}
    missing = [name for name in _PROJECTOR if name not in shapes]
    if missing:
        raise ValueError(f'{source}: the pixtral mmproj has no {", ".join(missing)} (Mistral 3\'s projector); '
                         f'Pixtral 12B\'s (LLaVA-style, without a patch merger) is not served')
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'image_size', 'patch_size', 'spatial_merge_size'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    width, merge = key('embedding_length'), key('spatial_merge_size')
    if shapes['mm.2.weight'][0] != text['hidden_size']:
        raise ValueError(f'{source}: the projector gives {shapes["mm.2.weight"][0]} features, the language model '
                         f'takes {text["hidden_size"]}: the mmproj is another model\'s')
    if shapes['mm.patch_merger.weight'][-1] != width * merge**2:
        raise ValueError(f'{source}: mm.patch_merger.weight takes {shapes["mm.patch_merger.weight"][-1]} features, '
                         f'not {merge} x {merge} patches of {width} (clip.vision.spatial_merge_size)')
    missing = [token for token in IMAGE_TOKENS if token not in tokens]
    if missing:
        raise ValueError(f'{source}: the tokenizer has no {", ".join(missing)} token (Mistral 3\'s image tokens)')
    heads = key('attention.head_count')
    vision = {'model_type': 'pixtral', 'hidden_size': width, 'intermediate_size': key('feed_forward_length'),
              'num_hidden_layers': key('block_count'), 'num_attention_heads': heads, 'head_dim': width // heads,
              'image_size': key('image_size'), 'patch_size': key('patch_size'),
              'hidden_act': _hidden_act(mmproj, source),
              'rope_parameters': {'rope_type': 'axial',
                                  'rope_theta': meta(mmproj, 'clip.rope.freq_base') or VISION_ROPE_THETA}}
    text_config = {k: v for k, v in text.items() if k != 'architectures'}
    if text_config['model_type'] == 'llama':
        text_config |= {'model_type': 'mistral', 'sliding_window': None}
    return {'model_type': 'mistral3', 'architectures': ['Mistral3ForConditionalGeneration'],
            'text_config': text_config, 'vision_config': vision, 'image_token_id': tokens.index(IMAGE_TOKENS[0]),
            'spatial_merge_size': merge, 'vision_feature_layer': -1, 'projector_hidden_act': 'gelu',
            'multimodal_projector_bias': 'mm.1.bias' in shapes, 'tie_word_embeddings': text['tie_word_embeddings'],
            'dtype': 'float32'}


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and projector's float32 tensors under the names of transformers' Mistral 3 checkpoints, the
    tower's q/k rows back in transformers' order."""
    heads = meta(mmproj, 'clip.vision.attention.head_count')
    state_dict = {}
    for name, value in float32_tensors(mmproj).items():
        block = TOWER_BLOCK.fullmatch(name)
        if block and block[2] in _BLOCK_NAMES:
            value = unpermute_rotary(value, heads) if block[2] in _ROTATED else value
            state_dict[f'{_TOWER}transformer.layers.{block[1]}.{_BLOCK_NAMES[block[2]]}.{block[3]}'] = value
        elif name in _NAMES:
            state_dict[_NAMES[name]] = value
        elif name != _IMG_BREAK_EMBEDDING:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """Pixtral's image processor as Mistral 3's checkpoints have it (resized, bicubic, to fit ``image_size`` on its
    longest edge in whole patches) with the mmproj's normalization."""
    patch, size = meta(mmproj, 'clip.vision.patch_size'), meta(mmproj, 'clip.vision.image_size')
    return {'image_processor_type': 'PixtralImageProcessor', 'size': {'longest_edge': size},
            'patch_size': {'height': patch, 'width': patch}, 'do_resize': True, 'resample': 3, 'do_rescale': True,
            'rescale_factor': 1 / 255, 'do_normalize': True, 'do_convert_rgb': True,
            'image_mean': meta(mmproj, 'clip.vision.image_mean'), 'image_std': meta(mmproj, 'clip.vision.image_std')}


PIXTRAL = VisionFamily(('mistral3', 'llama'), _config, _state_dict, _image_processor)
