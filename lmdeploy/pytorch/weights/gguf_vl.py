"""Vision-language models from llama.cpp's two files: the language model's GGUF and the ``mmproj`` GGUF
(architecture ``clip``) that convert_hf_to_gguf.py ``--mmproj`` writes for the vision tower and projector.
Qwen2-VL only: its tower's fixed shape (merge 2, temporal patch 2, QuickGELU) is what llama.cpp assumes too."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

# text architectures that need an mmproj file, by the mmproj projector type they pair with
VL_ARCHS = {'qwen2vl': 'qwen2vl_merger'}
QWEN_IMAGE_TOKENS = {'image_token_id': '<|image_pad|>', 'video_token_id': '<|video_pad|>',
                     'vision_start_token_id': '<|vision_start|>', 'vision_end_token_id': '<|vision_end|>'}
_BLOCK_NAMES = {'attn_out': 'attn.proj', 'ffn_up': 'mlp.fc1', 'ffn_down': 'mlp.fc2', 'ln1': 'norm1', 'ln2': 'norm2'}
_MERGER_NAMES = {'v.post_ln': 'merger.ln_q', 'mm.0': 'merger.mlp.0', 'mm.2': 'merger.mlp.2'}
_BLOCK = re.compile(r'v\.blk\.(\d+)\.(\w+)\.(weight|bias)')
_QKV = ('attn_q', 'attn_k', 'attn_v')
_PATCH = ('v.patch_embd.weight', 'v.patch_embd.weight.1')


def _meta(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def find_mmproj(gguf_path: Path) -> Path:
    """The one ``mmproj*.gguf`` file beside ``gguf_path`` (where llama.cpp users keep it)."""
    found = sorted(p for p in gguf_path.parent.glob('mmproj*.gguf') if p != gguf_path)
    if len(found) != 1:
        what = 'none' if not found else ', '.join(p.name for p in found)
        raise ValueError(f'{gguf_path} is the language model of a vision-language model: it needs exactly one '
                         f'mmproj*.gguf file (llama.cpp\'s vision tower) in the same folder; found {what}')
    return found[0]


def vl_config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
              source: str) -> dict[str, Any]:
    """A ``Qwen2VLConfig`` dict: ``text`` (the language model's config from its GGUF) with the M-RoPE
    sections of its file, the tower's shape from the mmproj metadata and the image tokens' ids."""
    projector = _meta(mmproj, 'clip.projector_type')
    if projector != VL_ARCHS['qwen2vl']:
        raise ValueError(f'{source}: mmproj projector {projector!r} does not pair with a qwen2vl language model '
                         f'(expected {VL_ARCHS["qwen2vl"]!r})')
    key = lambda name: _meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    width = key('embedding_length')
    vision = {'depth': key('block_count'), 'embed_dim': width, 'num_heads': key('attention.head_count'),
              'mlp_ratio': key('feed_forward_length') // width, 'hidden_size': key('projection_dim'),
              'patch_size': key('patch_size'), 'spatial_merge_size': 2, 'temporal_patch_size': 2,
              'hidden_act': 'quick_gelu', 'in_channels': 3}
    missing = [k for k, v in vision.items() if v is None]
    if missing:
        raise ValueError(f'{source}: mmproj lacks the vision metadata for {", ".join(missing)}')
    sections = _meta(reader, 'qwen2vl.rope.dimension_sections')
    if sections is None:
        raise ValueError(f'{source}: missing GGUF metadata: qwen2vl.rope.dimension_sections')
    ids = {name: tokens.index(token) for name, token in QWEN_IMAGE_TOKENS.items() if token in tokens}
    if 'image_token_id' not in ids:
        raise ValueError(f'{source}: the tokenizer has no {QWEN_IMAGE_TOKENS["image_token_id"]} token')
    rope = {'rope_type': 'default', 'rope_theta': text['rope_theta'], 'mrope_section': list(sections[:3])}
    text_config = {k: v for k, v in text.items() if k not in ('architectures', 'model_type')}
    text_config |= {'model_type': 'qwen2_vl_text', 'rope_parameters': rope}
    return {'model_type': 'qwen2_vl', 'architectures': ['Qwen2VLForConditionalGeneration'],
            'text_config': text_config, 'vision_config': vision, 'tie_word_embeddings': text['tie_word_embeddings'],
            'bos_token_id': text['bos_token_id'], 'eos_token_id': text['eos_token_id'], 'dtype': 'float32', **ids}


def vision_state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and projector's float32 tensors under the ``visual.*`` names of Qwen2-VL's checkpoints:
    q/k/v joined back into ``qkv`` and the two Conv2d halves stacked back into the Conv3d patch embedding."""
    raw = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
           for t in mmproj.tensors}
    state_dict, qkv = {}, {}
    for name, value in raw.items():
        if name in _PATCH:
            continue
        block = _BLOCK.fullmatch(name)
        stem, _, kind = name.rpartition('.')
        if block and block[2] in _QKV:
            qkv.setdefault(f'visual.blocks.{block[1]}.attn.qkv.{block[3]}', {})[block[2]] = value
        elif block and block[2] in _BLOCK_NAMES:
            state_dict[f'visual.blocks.{block[1]}.{_BLOCK_NAMES[block[2]]}.{block[3]}'] = value
        elif stem in _MERGER_NAMES:
            state_dict[f'visual.{_MERGER_NAMES[stem]}.{kind}'] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no Qwen2-VL counterpart')
    for name, parts in qkv.items():
        state_dict[name] = torch.cat([parts[part] for part in _QKV])
    if any(name not in raw for name in _PATCH):
        raise ValueError(f'mmproj lacks the patch embedding ({", ".join(_PATCH)})')
    state_dict['visual.patch_embed.proj.weight'] = torch.stack([raw[name] for name in _PATCH], dim=2)
    return state_dict


def image_processor_config(mmproj: GGUFReader) -> dict[str, Any]:
    """Qwen2-VL's image processor with the mmproj's normalization and patch size (the rest its defaults)."""
    return {'image_processor_type': 'Qwen2VLImageProcessor', 'patch_size': _meta(mmproj, 'clip.vision.patch_size'),
            'merge_size': 2, 'temporal_patch_size': 2, 'image_mean': _meta(mmproj, 'clip.vision.image_mean'),
            'image_std': _meta(mmproj, 'clip.vision.image_std')}
