"""GLM-4.1V, GLM-4.5V and GLM-4.6V from llama.cpp's files: a ``glm4`` (GLM-4.1V) or ``glm4moe`` (GLM-4.5V, GLM-4.6V)
language model, whose ``rope.dimension_sections`` are its M-RoPE bands, and an mmproj of projector ``glm4v``
(convert_hf_to_gguf.py ``--mmproj``: Glm4VVisionModel, Qwen3-VL's tower conversion). The mmproj keeps q/k/v fused,
splits the Conv3d patch embedding into two Conv2d halves, names the merging convolution ``mm.patch_merger`` and the
gated merger ``mm.model.fc``, ``mm.post_norm``, ``mm.gate``/``mm.up``/``mm.down``. It has no key for the merge size
(the merging convolution's kernel is it) nor for the tower's MLP width (its ``feed_forward_length`` is the merger's;
the blocks' MLP is ``out_hidden_size`` wide). GLM-4.1V's language model has its q/k rotary rows in halves there
(the converter reorders GLM's neighbouring pairs for llama.cpp's M-RoPE): see ``gguf_tensors.py``. The image
processor is transformers' ``Glm4vImageProcessor`` with its defaults and the mmproj's normalization."""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader, Keys

from .common import TOWER_BLOCK, VisionFamily, float32_tensors, meta, require_vision_keys
from .qwen2 import PATCH_HALVES, conv3d_patch_weight

GLM_IMAGE_TOKENS = {'image_token_id': '<|image|>', 'image_start_token_id': '<|begin_of_image|>',
                    'image_end_token_id': '<|end_of_image|>', 'video_token_id': '<|video|>',
                    'video_start_token_id': '<|begin_of_video|>', 'video_end_token_id': '<|end_of_video|>'}
# language-model architecture -> (model type, text model type, architecture)
_MODELS = {'glm4': ('glm4v', 'glm4v_text', 'Glm4vForConditionalGeneration'),
           'glm4moe': ('glm4v_moe', 'glm4v_moe_text', 'Glm4vMoeForConditionalGeneration')}
_VISUAL = 'model.visual.'
_BLOCK_NAMES = {'attn_qkv': 'attn.qkv', 'attn_out': 'attn.proj', 'ln1': 'norm1', 'ln2': 'norm2',
                'ffn_gate': 'mlp.gate_proj', 'ffn_up': 'mlp.up_proj', 'ffn_down': 'mlp.down_proj'}
_OTHER_NAMES = {'v.patch_embd.bias': 'patch_embed.proj.bias', 'v.norm_embd': 'post_conv_layernorm',
                'v.position_embd': 'embeddings.position_embedding', 'v.post_ln': 'post_layernorm',
                'mm.patch_merger': 'downsample', 'mm.model.fc': 'merger.proj',
                'mm.post_norm': 'merger.post_projection_norm', 'mm.gate': 'merger.gate_proj',
                'mm.up': 'merger.up_proj', 'mm.down': 'merger.down_proj'}
_REQUIRED = ('v.position_embd.weight', 'mm.patch_merger.weight', 'mm.model.fc.weight', 'v.blk.0.ffn_up.weight',
             *PATCH_HALVES)


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """A ``Glm4vConfig`` or ``Glm4vMoeConfig`` dict (by the language model's architecture): ``text`` with the M-RoPE
    bands of its file, the tower's shape from the mmproj's metadata and tensors, GLM's image and video tokens."""
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'patch_size', 'image_size'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in mmproj.tensors}
    missing = [name for name in _REQUIRED if name not in shapes]
    if missing:
        raise ValueError(f'{source}: the glm4v mmproj needs {", ".join(missing)}')
    out_hidden = shapes['mm.patch_merger.weight'][0]
    if shapes['mm.model.fc.weight'][0] != text['hidden_size']:
        raise ValueError(f'{source}: the projector gives {shapes["mm.model.fc.weight"][0]} features, the language '
                         f'model takes {text["hidden_size"]}: the mmproj is another model\'s')
    arch = meta(reader, 'general.architecture')
    sections_key = f'{arch}.rope.dimension_sections'
    sections = meta(reader, sections_key)
    if sections is None:
        raise ValueError(f'{source}: missing GGUF metadata: {sections_key} (a GLM-4V language model\'s M-RoPE)')
    missing_tokens = [token for token in GLM_IMAGE_TOKENS.values() if token not in tokens]
    if missing_tokens:
        raise ValueError(f'{source}: the tokenizer lacks GLM-4V\'s {", ".join(missing_tokens)}')
    model_type, text_type, architecture = _MODELS[arch]
    vision = {'depth': key('block_count'), 'hidden_size': key('embedding_length'),
              'intermediate_size': key('feed_forward_length'), 'num_heads': key('attention.head_count'),
              'out_hidden_size': out_hidden, 'patch_size': key('patch_size'), 'image_size': key('image_size'),
              'spatial_merge_size': shapes['mm.patch_merger.weight'][-1], 'temporal_patch_size': 2, 'in_channels': 3,
              'rms_norm_eps': key('attention.layer_norm_epsilon') or 1e-5,
              'hidden_act': 'silu' if meta(mmproj, Keys.ClipVision.USE_SILU) else 'gelu', 'attention_bias': 'v.blk.0.attn_qkv.bias' in shapes}
    rope = text['rope_parameters'] | {'mrope_section': list(sections[:3])}
    text_config = {k: v for k, v in text.items() if k not in ('architectures', 'model_type')}
    text_config |= {'model_type': text_type, 'rope_parameters': rope}
    return {'model_type': model_type, 'architectures': [architecture], 'text_config': text_config,
            'vision_config': vision, 'tie_word_embeddings': text['tie_word_embeddings'],
            'eos_token_id': text['eos_token_id'], 'dtype': 'float32',
            **{name: tokens.index(token) for name, token in GLM_IMAGE_TOKENS.items()}}


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and merger's float32 tensors under the ``model.visual.*`` names of transformers' GLM-4V checkpoints,
    the two Conv2d halves stacked back into the Conv3d patch embedding."""
    raw = float32_tensors(mmproj)
    state_dict = {_VISUAL + 'patch_embed.proj.weight': conv3d_patch_weight(raw)}
    for name, value in raw.items():
        if name in PATCH_HALVES:
            continue
        block = TOWER_BLOCK.fullmatch(name)
        stem, _, kind = name.rpartition('.')
        if block and block[2] in _BLOCK_NAMES:
            state_dict[f'{_VISUAL}blocks.{block[1]}.{_BLOCK_NAMES[block[2]]}.{block[3]}'] = value
        elif name in _OTHER_NAMES:
            state_dict[_VISUAL + _OTHER_NAMES[name]] = value
        elif stem in _OTHER_NAMES:
            state_dict[f'{_VISUAL}{_OTHER_NAMES[stem]}.{kind}'] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """transformers' ``Glm4vImageProcessor`` (its defaults: those of the hub's checkpoints) with the mmproj's patch
    size, merge size and normalization."""
    merger = next(t for t in mmproj.tensors if t.name == 'mm.patch_merger.weight')
    return {'image_processor_type': 'Glm4vImageProcessor', 'patch_size': meta(mmproj, 'clip.vision.patch_size'),
            'merge_size': int(merger.shape[0]), 'temporal_patch_size': 2,
            'image_mean': meta(mmproj, 'clip.vision.image_mean'), 'image_std': meta(mmproj, 'clip.vision.image_std')}


GLM4V = VisionFamily(tuple(_MODELS), _config, _state_dict, _image_processor)
