"""Gemma 3 with images from llama.cpp's two GGUF files: a tiny random transformers ``Gemma3ForConditionalGeneration``
whose language model is written as convert_hf_to_gguf.py's Gemma3Model writes it (arch ``gemma3``, norms as
``1 + weight``) and whose tower and projector as its Gemma3VisionModel ``--mmproj`` writes them (projector
``gemma3``: gguf-py's names, the tower's head dropped, the input projection in float16, the soft-embedding norm as
``1 + weight``, the pooling step as ``clip.vision.projector.scale_factor``), served token for token like the
safetensors original on text, one-image and two-image prompts; and the errors for an incomplete mmproj."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf import finish
from test_gguf_vl import (_tokenizer, assert_serves_like_the_original, converted_tensors, f32_mmproj_writer,
                         vision_tower_metadata)
from transformers import AutoConfig
from vl_models import GEMMA3_TEXT, save_tiny_vl_model

from lmdeploy.pytorch.weights.gguf import resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

INPUT_PROJECTION = 'multi_modal_projector.mm_input_projection_weight'
# what llama.cpp can represent: queries scaled by 1/sqrt(head_dim), local layers on rope base 10000, every layer
# local (its fixed step of six for Gemma 3), no padding rows in the embedding (the converter cuts them)
LLAMA_CPP_TEXT = {'query_pre_attn_scalar': 16, 'vocab_size': 318, 'layer_types': ['sliding_attention'] * 3,
                  'rope_parameters': {'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0},
                                      'full_attention': {'rope_type': 'default', 'rope_theta': 1e6}}}


def write_gemma3_gguf(model_dir: str, out: Path) -> None:
    """The language model as convert_hf_to_gguf.py's Gemma3Model writes it (float32)."""
    text = AutoConfig.from_pretrained(model_dir).text_config
    writer = gguf.GGUFWriter(str(out), 'gemma3')
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_rope_freq_base(text.rope_parameters['full_attention']['rope_theta'])
    writer.add_rope_freq_base_swa(text.rope_parameters['sliding_attention']['rope_theta'])
    writer.add_sliding_window(text.sliding_window)
    writer.add_head_count_kv(text.num_key_value_heads)
    _tokenizer(model_dir, writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, text.num_hidden_layers)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if not name.startswith('language_model.'):
            continue
        data = value.numpy() + np.float32(1) if name.endswith('norm.weight') else value.numpy()
        writer.add_tensor(names.get_name(name.removeprefix('language_model.'), try_suffixes=('.weight', '.bias')),
                          data)
    finish(writer)


def write_gemma3_mmproj(model_dir: str, out: Path, skip_key: str | None = None) -> None:
    """The tower and projector as convert_hf_to_gguf.py ``--mmproj --outtype f32`` writes them (hub checkpoints name
    the tower ``vision_tower.vision_model.*``); ``skip_key``: a metadata key left out."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    writer = f32_mmproj_writer(out)
    metadata = vision_tower_metadata(writer, vision, config.text_config.hidden_size, [0.5] * 3, [0.5] * 3)
    for key, (add, value) in metadata.items():
        if key != skip_key:
            add(value)
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    image_seq_length = json.loads(Path(model_dir, 'preprocessor_config.json').read_text())['image_seq_length']
    scale_factor = side // int(image_seq_length**0.5)
    if scale_factor not in (0, 4):  # the converter writes only a scale other than llama.cpp's
        writer.add_vision_projector_scale_factor(scale_factor)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if name.startswith('vision_tower.head.') or name.startswith('language_model.'):
            continue
        hub_name = name.replace('vision_tower.', 'vision_tower.vision_model.').replace('_weight', '.weight')
        data = value.numpy()
        if name.endswith('soft_emb_norm.weight'):
            data = data + np.float32(1)
        elif name == INPUT_PROJECTION:
            data = data.astype(np.float16)
        writer.add_tensor(names.get_name(hub_name, try_suffixes=('.weight', '.bias')), data)
    finish(writer)


@pytest.fixture(scope='module')
def gemma3(tmp_path_factory) -> str:
    """A tiny Gemma 3 that llama.cpp represents, its input projection holding float16 values (which the file keeps
    exactly), its ``image_seq_length`` in the image processor's config, where the converter reads it."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in LLAMA_CPP_TEXT.items():
            patch.setitem(GEMMA3_TEXT, key, value)
        path = save_tiny_vl_model('gemma3', str(tmp_path_factory.mktemp('gemma3')))
    processor = Path(path, 'preprocessor_config.json')  # the hub's Gemma 3 files name the tokens per image there
    processor.write_text(json.dumps(json.loads(processor.read_text()) | {'image_seq_length': 4}))
    state = load_file(f'{path}/model.safetensors')
    state[INPUT_PROJECTION] = state[INPUT_PROJECTION].half().float()
    save_file(state, f'{path}/model.safetensors', metadata={'format': 'pt'})
    return path


@pytest.fixture(scope='module')
def gguf_pair(gemma3, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_gemma3_gguf(gemma3, folder / 'gemma-3-tiny-F32.gguf')
    write_gemma3_mmproj(gemma3, folder / 'mmproj-gemma-3-tiny-F32.gguf')
    return folder


def test_gguf_pair_serves_image_prompts_like_the_original(gemma3, gguf_pair):
    model = str(gguf_pair / 'gemma-3-tiny-F32.gguf')
    folder = resolve_gguf(model)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == 'gemma3' and config.mm_tokens_per_image == 4
    original = load_file(f'{gemma3}/model.safetensors')
    converted = converted_tensors(folder)
    kept = {name.removeprefix('language_model.'): value for name, value in original.items()
            if not name.startswith('vision_tower.head.')}
    assert converted.keys() == kept.keys()
    assert all(torch.allclose(converted[name], value, rtol=0, atol=1e-6) for name, value in kept.items())
    assert_serves_like_the_original(gemma3, model, folder)


def test_incomplete_or_mismatched_mmproj(gemma3, gguf_pair, tmp_path):
    model = tmp_path / 'model.gguf'
    shutil.copy(gguf_pair / 'gemma-3-tiny-F32.gguf', model)
    mmproj = tmp_path / 'mmproj-model-f32.gguf'
    write_gemma3_mmproj(gemma3, mmproj, skip_key='block_count')
    with pytest.raises(ValueError, match='missing GGUF metadata: clip.vision.block_count'):
        resolve_gguf(str(model))
    writer = gguf.GGUFWriter(str(mmproj), 'clip')
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    for key in ('embedding_length', 'feed_forward_length', 'block_count', 'head_count', 'image_size', 'patch_size'):
        writer.add_uint32(f'clip.vision.{"attention." if key == "head_count" else ""}{key}', 1)
    writer.add_tensor('mm.soft_emb_norm.weight', np.zeros(4, dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match='needs mm.input_projection.weight and mm.soft_emb_norm.weight'):
        resolve_gguf(str(model))
