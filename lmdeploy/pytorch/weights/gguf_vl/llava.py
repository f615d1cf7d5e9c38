"""LLaVA (1.5-style: a CLIP tower, a two-layer MLP projector) from llama.cpp's files: a plain ``llama``, ``qwen2``
or ``qwen3`` language model and an mmproj of projector ``mlp``, which llama.cpp's legacy script
convert_image_encoder_to_gguf.py writes. That script keeps the tower's layers up to the one LLaVA takes its features
from (``clip.vision.feature_layer``, or all but the last) and leaves out the final layer norm; the features skip the
CLS token. LLaVA-NeXT's tiled images (``image_grid_pinpoints``) are not served."""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader

from .common import TOWER_BLOCK, VisionFamily, float32_tensors, meta, require_vision_keys

IMAGE_TOKEN = '<image>'
_TOWER = 'vision_tower'
_BLOCK_NAMES = {'attn_q': 'self_attn.q_proj', 'attn_k': 'self_attn.k_proj', 'attn_v': 'self_attn.v_proj',
                'attn_out': 'self_attn.out_proj', 'ln1': 'layer_norm1', 'ln2': 'layer_norm2'}
_NAMES = {'v.class_embd': 'embeddings.class_embedding', 'v.patch_embd.weight': 'embeddings.patch_embedding.weight',
          'v.position_embd.weight': 'embeddings.position_embedding.weight', 'v.pre_ln.weight': 'pre_layrnorm.weight',
          'v.pre_ln.bias': 'pre_layrnorm.bias'}
_PROJECTOR = {'mm.0': 'multi_modal_projector.linear_1', 'mm.2': 'multi_modal_projector.linear_2'}


def _refuse_unserved(mmproj: GGUFReader, source: str) -> None:
    """Raise for mmproj files of projector ``mlp`` that are not LLaVA 1.5's shape."""
    names = {t.name for t in mmproj.tensors}
    tiled = (meta(mmproj, 'clip.vision.mm_patch_merge_type') == 'spatial_unpad' or
             meta(mmproj, 'clip.vision.image_grid_pinpoints') is not None)
    if tiled or any('image_newline' in n for n in names):
        raise ValueError(f'{source}: a LLaVA-NeXT (LLaVA 1.6) mmproj (tiled images: image_grid_pinpoints, '
                         f'image_newline); only LLaVA 1.5-style models are served from GGUF')
    if 'mm.3.weight' in names or 'mm.2.weight' not in names:
        raise ValueError(f'{source}: the mlp projector must be mm.0 and mm.2 (two linear layers) only; '
                         f'found {", ".join(sorted(n for n in names if n.startswith("mm.")))}')
    if 'v.class_embd' not in names:
        raise ValueError(f'{source}: the tower has no v.class_embd: only CLIP towers are served')
    if 'v.post_ln.weight' in names:
        raise ValueError(f'{source}: the tower ends in v.post_ln, which LLaVA\'s features do not pass')


def _config(text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader, tokens: list[str],
            source: str) -> dict[str, Any]:
    """A ``LlavaConfig`` dict: ``text`` (the language model's config from its GGUF), a CLIP tower of the layers the
    mmproj holds, features from the layers it names (else its last), the CLS token dropped, and the ``<image>``
    token's id."""
    _refuse_unserved(mmproj, source)
    require_vision_keys(mmproj, ('embedding_length', 'feed_forward_length', 'block_count', 'attention.head_count',
                                 'image_size', 'patch_size'), source)
    key = lambda name: meta(mmproj, f'clip.vision.{name}')  # noqa: E731
    width = next(t.data.shape[0] for t in mmproj.tensors if t.name == 'mm.2.weight')
    if width != text['hidden_size']:
        raise ValueError(f'{source}: the projector gives {width} features, the language model takes '
                         f'{text["hidden_size"]}: the mmproj is another model\'s')
    if IMAGE_TOKEN not in tokens:
        raise ValueError(f'{source}: the language model\'s tokenizer has no {IMAGE_TOKEN} token (a LLaVA checkpoint '
                         f'in transformers\' layout, llava-hf, has one); without the mmproj beside it, the file is '
                         f'served as a text model')
    vision = {'model_type': 'clip_vision_model', 'hidden_size': key('embedding_length'),
              'intermediate_size': key('feed_forward_length'), 'num_hidden_layers': key('block_count'),
              'num_attention_heads': key('attention.head_count'), 'image_size': key('image_size'),
              'patch_size': key('patch_size'), 'layer_norm_eps': key('attention.layer_norm_epsilon') or 1e-5,
              'hidden_act': 'gelu' if meta(mmproj, 'clip.use_gelu') else 'quick_gelu',
              'projection_dim': key('projection_dim') or text['hidden_size']}
    layers = [int(layer) for layer in key('feature_layer') or [-1]]
    if max(layers) > vision['num_hidden_layers']:
        raise ValueError(f'{source}: clip.vision.feature_layer {layers} lies beyond the tower\'s '
                         f'{vision["num_hidden_layers"]} layers')
    text_config = {k: v for k, v in text.items() if k != 'architectures'}
    bias = any(t.name == 'mm.0.bias' for t in mmproj.tensors)
    return {'model_type': 'llava', 'architectures': ['LlavaForConditionalGeneration'], 'text_config': text_config,
            'vision_config': vision, 'vision_feature_layer': layers[0] if len(layers) == 1 else layers,
            'vision_feature_select_strategy': 'default', 'image_token_id': tokens.index(IMAGE_TOKEN),
            'image_seq_length': (vision['image_size'] // vision['patch_size'])**2, 'projector_hidden_act': 'gelu',
            'multimodal_projector_bias': bias, 'tie_word_embeddings': text['tie_word_embeddings'], 'dtype': 'float32'}


def _state_dict(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """The tower's and projector's float32 tensors under the names of LLaVA's transformers checkpoints. The legacy
    script names each layer's ``fc1`` ``ffn_down`` and ``fc2`` ``ffn_up``; as llama.cpp does, the pair is taken as
    swapped where ``ffn_down`` reads the tower's width."""
    raw = float32_tensors(mmproj)
    width = meta(mmproj, 'clip.vision.embedding_length')
    state_dict = {}
    for name, value in raw.items():
        block = TOWER_BLOCK.fullmatch(name)
        stem, _, kind = name.rpartition('.')
        if block and block[2] in _BLOCK_NAMES:
            state_dict[f'{_TOWER}.encoder.layers.{block[1]}.{_BLOCK_NAMES[block[2]]}.{block[3]}'] = value
        elif block and block[2] in ('ffn_up', 'ffn_down'):
            swapped = raw[f'v.blk.{block[1]}.ffn_down.weight'].shape[-1] == width
            fc = 'fc1' if block[2] == ('ffn_down' if swapped else 'ffn_up') else 'fc2'
            state_dict[f'{_TOWER}.encoder.layers.{block[1]}.mlp.{fc}.{block[3]}'] = value
        elif name in _NAMES:
            state_dict[f'{_TOWER}.{_NAMES[name]}'] = value
        elif stem in _PROJECTOR:
            state_dict[f'{_PROJECTOR[stem]}.{kind}'] = value
        else:
            raise ValueError(f'mmproj tensor {name} has no transformers counterpart')
    # the tower's final norm, which the features never pass (and llama.cpp's file leaves out): an identity
    state_dict[f'{_TOWER}.post_layernorm.weight'] = torch.ones(width)
    state_dict[f'{_TOWER}.post_layernorm.bias'] = torch.zeros(width)
    return state_dict


def _image_processor(mmproj: GGUFReader) -> dict[str, Any]:
    """CLIP's image processor as LLaVA's transformers checkpoints have it (shortest side resized to the tower's size,
    then centre-cropped to a square) with the mmproj's size and normalization."""
    size = meta(mmproj, 'clip.vision.image_size')
    return {'image_processor_type': 'CLIPImageProcessor', 'size': {'shortest_edge': size},
            'crop_size': {'height': size, 'width': size}, 'do_resize': True, 'do_center_crop': True, 'resample': 3,
            'do_rescale': True, 'rescale_factor': 1 / 255, 'do_normalize': True, 'do_convert_rgb': True,
            'image_mean': meta(mmproj, 'clip.vision.image_mean'), 'image_std': meta(mmproj, 'clip.vision.image_std')}


LLAVA = VisionFamily(('llama', 'qwen2', 'qwen3'), _config, _state_dict, _image_processor)
