"""InternVL 3 from llama.cpp's files: a plain ``qwen2`` or ``llama`` language model and an mmproj of projector
``internvl`` (converted from OpenGVLab's remote-code checkpoints), served as transformers'
``InternVLForConditionalGeneration``. What the mmproj leaves out is taken as llama.cpp takes it: the tower's last
layer feeds the projector, its CLS token is dropped, the projector's activation is GELU, 1 to 12 tiles per image
where the file states no limits, and the tower's norms are RMS norms where they have no bias (InternViT-6B)."""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader

from .common import TOWER_BLOCK, VisionFamily, float32_tensors, meta, require_vision_keys

INTERNVL_IMAGE_TOKENS = ('<IMG_CONTEXT>', '<img>', '</img>')  # the image's placeholder, then its span's ends
MIN_TILES, MAX_TILES = 1, 12  # llama.cpp's tiles per image where the mmproj states none
_TOWER = 'vision_tower.'
_PROJECTOR = 'multi_modal_projector.'
_EMBEDDINGS = {'v.class_embd': 'embeddings.cls_token', 'v.position_embd.weight': 'embeddings.position_embeddings'}
_PATCH = 'embeddings.patch_embeddings.projection'
_BLOCK_NAMES = {'attn_q': 'attention.q_proj', 'attn_k': 'attention.k_proj', 'attn_v': 'attention.v_proj',
                'attn_out': 'attention.projection_layer', 'attn_q_norm': 'attention.q_norm',
                'attn_k_norm': 'attention.k_norm', 'ln1': 'layernorm_before', 'ln2': 'layernorm_after',
                'ffn_up': 'mlp.fc1', 'ffn_down': 'mlp.fc2'}
_LAYER_SCALES = {'ls1': 'lambda_1', 'ls2': 'lambda_2'}  # parameters of their own, without '.weight'
_PROJECTOR_NAMES = {'mm.model.mlp.0': 'layer_norm', 'mm.model.mlp.1': 'linear_1', 'mm.model.mlp.3': 'linear_2'}
_ACTIVATIONS = {'clip.use_gelu': 'gelu', 'clip.use_silu': 'silu'}


def _vision_config(mmproj: GGUFReader, source: str) -> dict[str, Any]:
    """The InternViT tower's ``InternVLVisionConfig`` dict from the mmproj's metadata and tensors."""
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'image_size', 'patch_size'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    tensors = {t.name for t in mmproj.tensors}
    activation = [act for flag, act in _ACTIVATIONS.items() if meta(mmproj, flag)]
    if len(activation) != 1:
        raise ValueError(f'{source}: the mmproj must set one of {", ".join(_ACTIVATIONS)} for the tower')
    size, patch = key('image_size'), key('patch_size')
    return {'model_type': 'internvl_vision', 'hidden_size': key('embedding_length'),
            'intermediate_size': key('feed_forward_length'), 'num_hidden_layers': key('block_count'),
            'num_attention_heads': key('attention.head_count'), 'image_size': [size, size],
            'patch_size': [patch, patch], 'hidden_act': activation[0],
            'layer_norm_eps': key('attention.layer_norm_epsilon') or 1e-6,
            'attention_bias': 'v.blk.0.attn_q.bias' in tensors, 'use_qk_norm': 'v.blk.0.attn_q_norm.weight' in tensors,
            'norm_type': 'layer_norm' if 'v.blk.0.ln1.bias' in tensors else 'rms_norm'}


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """An ``InternVLConfig`` dict: ``text`` (the language model's config from its GGUF) as its text config, the
    tower from the mmproj, the pixel shuffle's ratio from ``clip.vision.projector.scale_factor`` and the image
    placeholder's id from the vocabulary (which must hold ``<img>`` and ``</img>`` too)."""
    vision = _vision_config(mmproj, source)
    scale = meta(mmproj, 'clip.vision.projector.scale_factor')
    if scale is None:
        raise ValueError(f'{source}: missing GGUF metadata: clip.vision.projector.scale_factor')
    missing = [token for token in INTERNVL_IMAGE_TOKENS if token not in tokens]
    if missing:
        raise ValueError(f'{source}: the tokenizer has no {", ".join(missing)} token (InternVL\'s image tokens)')
    patches = (vision['image_size'][0] // vision['patch_size'][0])**2
    text_config = {k: v for k, v in text.items() if k != 'architectures'}
    return {'model_type': 'internvl', 'architectures': ['InternVLForConditionalGeneration'],
            'text_config': text_config, 'vision_config': vision, 'downsample_ratio': 1 / scale,
            'projector_hidden_act': 'gelu', 'vision_feature_layer': -1, 'vision_feature_select_strategy': 'default',
            'image_token_id': tokens.index(INTERNVL_IMAGE_TOKENS[0]), 'image_seq_length': patches // scale**2,
            'tie_word_embeddings': text['tie_word_embeddings'], 'bos_token_id': text['bos_token_id'],
            'eos_token_id': text['eos_token_id'], 'dtype': 'float32'}


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and projector's float32 tensors under the names of transformers' InternVL checkpoints
    (``vision_tower.*``, ``multi_modal_projector.*``); q, k and v stay separate, as there."""
    state_dict = {}
    for name, value in float32_tensors(mmproj).items():
        block = TOWER_BLOCK.fullmatch(name)
        stem, _, kind = name.rpartition('.')
        if block and block[2] in _BLOCK_NAMES:
            state_dict[f'{_TOWER}encoder.layer.{block[1]}.{_BLOCK_NAMES[block[2]]}.{block[3]}'] = value
        elif block and block[2] in _LAYER_SCALES and block[3] == 'weight':
            state_dict[f'{_TOWER}encoder.layer.{block[1]}.{_LAYER_SCALES[block[2]]}'] = value
        elif name in _EMBEDDINGS:
            state_dict[f'{_TOWER}{_EMBEDDINGS[name]}'] = value
        elif stem == 'v.patch_embd':
            state_dict[f'{_TOWER}{_PATCH}.{kind}'] = value
        elif stem in _PROJECTOR_NAMES:
            state_dict[f'{_PROJECTOR}{_PROJECTOR_NAMES[stem]}.{kind}'] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """InternVL's image processor (GOT-OCR 2's, whose ``crop_to_patches`` lmdeploy turns on): square tiles of
    the tower's size, bicubic, the file's normalization and tile limits (llama.cpp's 1 and 12 where it has
    none)."""
    size = meta(mmproj, 'clip.vision.image_size')
    return {'image_processor_type': 'GotOcr2ImageProcessor', 'size': {'height': size, 'width': size},
            'min_patches': meta(mmproj, 'clip.vision.preproc_min_tiles') or MIN_TILES,
            'max_patches': meta(mmproj, 'clip.vision.preproc_max_tiles') or MAX_TILES, 'resample': 3,
            'image_mean': meta(mmproj, 'clip.vision.image_mean'), 'image_std': meta(mmproj, 'clip.vision.image_std')}


INTERNVL = VisionFamily(('qwen2', 'llama'), _config, _state_dict, _image_processor)
