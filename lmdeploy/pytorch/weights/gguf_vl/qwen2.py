"""Qwen2-VL and Qwen2.5-VL from llama.cpp's files: a ``qwen2vl`` language model and an mmproj of projector
``qwen2vl_merger`` or ``qwen2.5vl_merger`` (which decides the model). What their mmproj files leave out (merge
2, temporal patch 2, Qwen2.5-VL's 112 px attention windows) is taken as llama.cpp takes it."""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader

from .common import TOWER_BLOCK, VisionFamily, float32_tensors, meta, require_vision_keys

QWEN25_WINDOW = 112  # llama.cpp's window when the file states none (as the converter writes them)
QWEN_IMAGE_TOKENS = {'image_token_id': '<|image_pad|>', 'video_token_id': '<|video_pad|>',
                     'vision_start_token_id': '<|vision_start|>', 'vision_end_token_id': '<|vision_end|>'}
_BLOCK_NAMES = {'attn_out': 'attn.proj', 'ln1': 'norm1', 'ln2': 'norm2'}
_MLP_NAMES = {'qwen2vl_merger': {'ffn_up': 'mlp.fc1', 'ffn_down': 'mlp.fc2'},
              'qwen2.5vl_merger': {'ffn_up': 'mlp.up_proj', 'ffn_down': 'mlp.down_proj', 'ffn_gate': 'mlp.gate_proj'}}
_MERGER_NAMES = {'v.post_ln': 'merger.ln_q', 'mm.0': 'merger.mlp.0', 'mm.2': 'merger.mlp.2'}
_QKV = ('attn_q', 'attn_k', 'attn_v')
PATCH_HALVES = ('v.patch_embd.weight', 'v.patch_embd.weight.1')  # the Conv3d's two time steps


def qwen_vl_config(text: dict[str, Any], reader: GGUFReader, tokens: list[str], source: str, model_type: str,
                   architecture: str, vision: dict[str, Any]) -> dict[str, Any]:
    """The config dict of a Qwen-VL model of ``model_type``: ``text`` (the language model's config from its
    GGUF) with the M-RoPE sections of its file, the ``vision`` config and the image tokens' ids."""
    sections_key = f'{meta(reader, "general.architecture")}.rope.dimension_sections'
    sections = meta(reader, sections_key)
    if sections is None:
        raise ValueError(f'{source}: missing GGUF metadata: {sections_key}')
    ids = {name: tokens.index(token) for name, token in QWEN_IMAGE_TOKENS.items() if token in tokens}
    if 'image_token_id' not in ids:
        raise ValueError(f'{source}: the tokenizer has no {QWEN_IMAGE_TOKENS["image_token_id"]} token')
    # the language model's rotary (Qwen3.5's: over part of each head, interleaved) with the file's sections
    rope = text.get('rope_parameters', {'rope_type': 'default', 'rope_theta': text['rope_theta']})
    rope = rope | {'mrope_section': list(sections[:3])}
    text_config = {k: v for k, v in text.items() if k not in ('architectures', 'model_type')}
    text_config |= {'model_type': f'{model_type}_text', 'rope_parameters': rope}
    return {'model_type': model_type, 'architectures': [architecture],
            'text_config': text_config, 'vision_config': vision, 'tie_word_embeddings': text['tie_word_embeddings'],
            'bos_token_id': text['bos_token_id'], 'eos_token_id': text['eos_token_id'], 'dtype': 'float32', **ids}


def conv3d_patch_weight(raw: dict[str, torch.Tensor]) -> torch.Tensor:
    """The Conv3d patch embedding's weight, stacked back from the mmproj's two Conv2d halves (``raw``: the
    mmproj's tensors by GGUF name)."""
    if any(name not in raw for name in PATCH_HALVES):
        raise ValueError(f'mmproj lacks the patch embedding ({", ".join(PATCH_HALVES)})')
    return torch.stack([raw[name] for name in PATCH_HALVES], dim=2)


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """A ``Qwen2VLConfig`` or ``Qwen2_5_VLConfig`` dict (by the mmproj's projector), the tower's shape from the
    mmproj metadata."""
    projector = meta(mmproj, 'clip.projector_type')
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'projection_dim', 'patch_size') +
                        (('n_wa_pattern', ) if projector == 'qwen2.5vl_merger' else ()), source)
    width, depth, pattern = key('embedding_length'), key('block_count'), key('n_wa_pattern')
    vision = {'depth': depth, 'num_heads': key('attention.head_count'), 'patch_size': key('patch_size'),
              'spatial_merge_size': 2, 'temporal_patch_size': 2, 'in_channels': 3}
    if projector == 'qwen2vl_merger':
        model_type, architecture = 'qwen2_vl', 'Qwen2VLForConditionalGeneration'
        vision |= {'embed_dim': width, 'mlp_ratio': key('feed_forward_length') // width,
                   'hidden_size': key('projection_dim'), 'hidden_act': 'quick_gelu'}
    else:  # full attention in every ``pattern``-th block, windows in the others
        model_type, architecture = 'qwen2_5_vl', 'Qwen2_5_VLForConditionalGeneration'
        vision |= {'hidden_size': width, 'intermediate_size': key('feed_forward_length'),
                   'out_hidden_size': key('projection_dim'), 'hidden_act': 'silu', 'window_size': QWEN25_WINDOW,
                   'fullatt_block_indexes': list(range(pattern - 1, depth, pattern))}
    return qwen_vl_config(text, reader, tokens, source, model_type, architecture, vision)


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and projector's float32 tensors under the ``visual.*`` names of Qwen2-VL's (Qwen2.5-VL's)
    checkpoints: q/k/v joined back into ``qkv`` and the two Conv2d halves stacked back into the Conv3d patch
    embedding."""
    block_names = _BLOCK_NAMES | _MLP_NAMES[meta(mmproj, 'clip.projector_type')]
    raw = float32_tensors(mmproj)
    state_dict, qkv = {}, {}
    for name, value in raw.items():
        if name in PATCH_HALVES:
            continue
        block = TOWER_BLOCK.fullmatch(name)
        stem, _, kind = name.rpartition('.')
        if block and block[2] in _QKV:
            qkv.setdefault(f'visual.blocks.{block[1]}.attn.qkv.{block[3]}', {})[block[2]] = value
        elif block and block[2] in block_names:
            state_dict[f'visual.blocks.{block[1]}.{block_names[block[2]]}.{block[3]}'] = value
        elif stem in _MERGER_NAMES:
            state_dict[f'visual.{_MERGER_NAMES[stem]}.{kind}'] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    for name, parts in qkv.items():
        state_dict[name] = torch.cat([parts[part] for part in _QKV])
    state_dict['visual.patch_embed.proj.weight'] = conv3d_patch_weight(raw)
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """Qwen2-VL's image processor (Qwen2.5-VL's too) with the mmproj's normalization and patch size (the rest
    its defaults)."""
    return {'image_processor_type': 'Qwen2VLImageProcessor', 'patch_size': meta(mmproj, 'clip.vision.patch_size'),
            'merge_size': 2, 'temporal_patch_size': 2, 'image_mean': meta(mmproj, 'clip.vision.image_mean'),
            'image_std': meta(mmproj, 'clip.vision.image_std')}


QWEN2_VL = VisionFamily(('qwen2vl', ), _config, _state_dict, _image_processor)
