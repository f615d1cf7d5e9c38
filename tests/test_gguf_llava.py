"""LLaVA from llama.cpp's two GGUF files: a tiny random transformers LLaVA (a Llama, Qwen2 or Qwen3 language model)
whose language model is written as convert_hf_to_gguf.py writes it (arch ``llama``, ``qwen2``, ``qwen3``) and whose
tower and projector are written as llama.cpp's legacy convert_image_encoder_to_gguf.py ``--use-f32`` writes them
(projector ``mlp``: the tower's last layer and final norm left out, its names, ``fc1``/``fc2`` stored as
``ffn_down``/``ffn_up``, the patch embedding and the projector's matrices in float16), served token for token like the
safetensors original on image prompts; and the errors for an mmproj that is not LLaVA 1.5's and a tokenizer without
``<image>``."""
from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf import finish, llama_permute, make_gguf
from test_gguf_vl import _tokenizer, assert_serves_like_the_original, converted_tensors
from transformers import AutoConfig
from vl_models import save_tiny_vl_model

from lmdeploy.pytorch.weights.gguf import resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

TEXT_ARCHS = {'llama': gguf.MODEL_ARCH.LLAMA, 'qwen2': gguf.MODEL_ARCH.QWEN2, 'qwen3': gguf.MODEL_ARCH.QWEN3}
# the legacy script's names for a CLIP tower's tensors (its string replacements, applied to ``vision_model.*``)
LEGACY_NAMES = {'embeddings.class_embedding': 'v.class_embd',
                'embeddings.patch_embedding.weight': 'v.patch_embd.weight',
                'embeddings.position_embedding.weight': 'v.position_embd.weight', 'pre_layrnorm.': 'v.pre_ln.'}
LEGACY_LAYER_NAMES = {'self_attn.q_proj': 'attn_q', 'self_attn.k_proj': 'attn_k', 'self_attn.v_proj': 'attn_v',
                      'self_attn.out_proj': 'attn_out', 'layer_norm1': 'ln1', 'layer_norm2': 'ln2',
                      'mlp.fc1': 'ffn_down', 'mlp.fc2': 'ffn_up'}
# what the legacy script always stores in float16, even with --use-f32: the Conv2d and the projector's matrices
FLOAT16 = ('vision_tower.embeddings.patch_embedding.weight', 'multi_modal_projector.linear_1.weight',
           'multi_modal_projector.linear_2.weight')


def text_name(name: str) -> str | None:
    """The language model's name of a LLaVA checkpoint tensor (as the exported language model has it), or None."""
    if name.startswith('language_model.'):
        return name.removeprefix('language_model.')
    return None


def write_text_gguf(model_dir: str, out: Path) -> None:
    """The language model, exported from LLaVA, as convert_hf_to_gguf.py writes it (LlamaModel / Qwen2Model, f32)."""
    config = AutoConfig.from_pretrained(model_dir)
    text = config.text_config
    arch = TEXT_ARCHS[text.model_type]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_rope_freq_base(text.rope_parameters['rope_theta'])
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_rope_dimension_count(text.hidden_size // text.num_attention_heads)
    if arch == gguf.MODEL_ARCH.QWEN3:
        writer.add_key_length(text.head_dim)
        writer.add_value_length(text.head_dim)
    _tokenizer(model_dir, writer)
    names = gguf.get_tensor_name_map(arch, text.num_hidden_layers)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if (name := text_name(name)) is None:
            continue
        data = value.numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(('q_proj.weight', 'k_proj.weight')):
            data = llama_permute(data, text.num_attention_heads if 'q_proj' in name else text.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data))
    finish(writer)


def write_llava_mmproj(model_dir: str, out: Path, feature_layer: bool = False,
                       extra: dict[str, list[int]] | None = None) -> None:
    """The tower and projector as llava_surgery_v2.py + convert_image_encoder_to_gguf.py ``--clip-model-is-vision
    --use-f32`` write them. ``feature_layer``: the tower's config names LLaVA's layer (``mm_vision_select_layer``),
    which the script then writes; ``extra``: more array metadata."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    depth = vision.num_hidden_layers + config.vision_feature_layer + 1  # the layers up to LLaVA's
    writer = gguf.GGUFWriter(str(out), 'clip')
    writer.add_bool('clip.has_text_encoder', False)
    writer.add_bool('clip.has_vision_encoder', True)
    writer.add_bool('clip.has_llava_projector', True)
    writer.add_file_type(0)
    writer.add_description('image encoder for LLaVA')
    writer.add_string('clip.projector_type', 'mlp')
    for key, value in [('image_size', vision.image_size), ('patch_size', vision.patch_size),
                       ('embedding_length', vision.hidden_size), ('feed_forward_length', vision.intermediate_size),
                       ('projection_dim', vision.projection_dim), ('attention.head_count', vision.num_attention_heads),
                       ('block_count', depth)]:
        writer.add_uint32(f'clip.vision.{key}', value)
    writer.add_float32('clip.vision.attention.layer_norm_epsilon', vision.layer_norm_eps)
    if feature_layer:
        writer.add_array('clip.vision.feature_layer', [depth])
    for key, value in (extra or {}).items():
        writer.add_array(key, value)
    writer.add_array('clip.vision.image_mean', [0.48145466, 0.4578275, 0.40821073])  # the script's defaults
    writer.add_array('clip.vision.image_std', [0.26862954, 0.26130258, 0.27577711])
    writer.add_bool('clip.use_gelu', vision.hidden_act == 'gelu')
    state = load_file(f'{model_dir}/model.safetensors')
    for index in (1, 2):  # llava.projector first
        for kind in ('weight', 'bias'):
            value = state[f'multi_modal_projector.linear_{index}.{kind}'].numpy()  # matrices in float16
            writer.add_tensor(f'mm.{2 * index - 2}.{kind}', value.astype(np.float16 if value.ndim == 2 else np.float32))
    for name, value in state.items():
        if not name.startswith('vision_tower.') or 'post_layernorm' in name:
            continue
        stem = name.removeprefix('vision_tower.')
        if stem.startswith('encoder.layers.'):
            layer, rest = stem.removeprefix('encoder.layers.').split('.', 1)
            if int(layer) >= depth:
                continue
            module, _, kind = rest.rpartition('.')
            gguf_name = f'v.blk.{layer}.{LEGACY_LAYER_NAMES[module]}.{kind}'
        else:
            gguf_name = next(g + stem.removeprefix(h) for h, g in LEGACY_NAMES.items() if stem.startswith(h))
        data = value.numpy()
        writer.add_tensor(gguf_name, data.astype(np.float16) if data.ndim == 4 else data)
    finish(writer)


@pytest.fixture(scope='module', params=['llava', 'llava_qwen2', 'llava_qwen3'])
def llava(request, tmp_path_factory) -> str:
    """A tiny LLaVA whose tensors that the legacy script stores in float16 hold float16 values (so that the file
    keeps them exactly)."""
    path = save_tiny_vl_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    state = load_file(f'{path}/model.safetensors')
    state |= {name: state[name].half().float() for name in FLOAT16}
    save_file(state, f'{path}/model.safetensors', metadata={'format': 'pt'})
    return path


@pytest.fixture(scope='module')
def gguf_pair(llava, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_text_gguf(llava, folder / 'llava-tiny-F32.gguf')
    # the Qwen2 model's tower config names LLaVA's layer, so the script writes clip.vision.feature_layer
    qwen2 = AutoConfig.from_pretrained(llava).text_config.model_type == 'qwen2'
    write_llava_mmproj(llava, folder / 'mmproj-model-f32.gguf', feature_layer=qwen2)
    return folder


def test_gguf_pair_serves_image_prompts_like_the_original(llava, gguf_pair):
    model = str(gguf_pair / 'llava-tiny-F32.gguf')
    folder = resolve_gguf(model)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == 'llava' and config.vision_config.num_hidden_layers == 1
    original = load_file(f'{llava}/model.safetensors')
    converted = converted_tensors(folder)
    kept = {text_name(name) or name: value for name, value in original.items()
            if 'layers.1.' not in name or not name.startswith('vision_tower.')}
    assert converted.keys() == kept.keys()
    assert all(torch.equal(converted[name], value) for name, value in kept.items() if 'post_layernorm' not in name)
    assert_serves_like_the_original(llava, model, folder)


def _rename_token(path: Path, old: str, new: str) -> None:
    """Renames a token of a GGUF file's vocabulary in place (a name of the same length)."""
    reader = gguf.GGUFReader(str(path), 'r+')
    tokens = reader.fields['tokenizer.ggml.tokens']
    index = next(i for i in tokens.data if bytes(tokens.parts[i]) == old.encode())
    tokens.parts[index][:] = np.frombuffer(new.encode(), dtype=np.uint8)
    del reader


def test_mmproj_of_llava_next_or_other_projectors_and_no_image_token(llava, gguf_pair, tmp_path):
    model = tmp_path / 'model.gguf'
    shutil.copy(gguf_pair / 'llava-tiny-F32.gguf', model)
    mmproj = tmp_path / 'mmproj-model-f32.gguf'
    write_llava_mmproj(llava, mmproj, extra={'clip.vision.image_grid_pinpoints': [56, 112, 112, 56]})
    with pytest.raises(ValueError, match=r'LLaVA-NeXT .* only LLaVA 1.5-style models'):
        resolve_gguf(str(model))
    write_llava_mmproj(llava, mmproj, extra={'clip.vision.feature_layer': [2]})
    with pytest.raises(ValueError, match=r'feature_layer \[2\] lies beyond the tower\'s 1 layers'):
        resolve_gguf(str(model))
    shutil.copy(gguf_pair / 'mmproj-model-f32.gguf', mmproj)
    make_gguf(tmp_path / 'wider.gguf', hidden=128)
    with pytest.raises(ValueError, match='projector gives 64 features, the language model takes 128'):
        resolve_gguf(str(tmp_path / 'wider.gguf'))
    _rename_token(model, '<image>', '<imagf>')
    with pytest.raises(ValueError, match="tokenizer has no <image> token"):
        resolve_gguf(str(model))
    writer = gguf.GGUFWriter(str(mmproj), 'clip')
    writer.add_string('clip.projector_type', 'mlp')
    for name in ('v.class_embd', 'mm.0.weight', 'mm.2.weight'):
        writer.add_tensor(name, np.zeros(4, dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match='missing GGUF metadata: clip.vision.embedding_length'):
        resolve_gguf(str(model))


@pytest.mark.parametrize('tensors,message', [
    (('v.class_embd', 'mm.0.weight', 'mm.2.weight', 'mm.3.weight'), 'must be mm.0 and mm.2'),  # Yi-VL's
    (('v.class_embd', 'mm.0.weight'), 'must be mm.0 and mm.2'),
    (('mm.0.weight', 'mm.2.weight'), 'no v.class_embd: only CLIP towers'),  # SigLIP's
    (('v.class_embd', 'mm.0.weight', 'mm.2.weight', 'v.post_ln.weight'), 'ends in v.post_ln'),
    (('v.class_embd', 'mm.0.weight', 'mm.2.weight', 'model.image_newline'), 'LLaVA-NeXT'),
])
def test_mlp_mmproj_of_another_shape_is_refused(gguf_pair, tmp_path, tensors, message):
    shutil.copy(gguf_pair / 'llava-tiny-F32.gguf', tmp_path / 'model.gguf')
    writer = gguf.GGUFWriter(str(tmp_path / 'mmproj.gguf'), 'clip')
    writer.add_string('clip.projector_type', 'mlp')
    for name in tensors:
        writer.add_tensor(name, np.zeros(4, dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match=message):
        resolve_gguf(str(tmp_path / 'model.gguf'))
