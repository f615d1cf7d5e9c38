"""Mistral 3 with images from llama.cpp's two GGUF files: tiny random transformers ``Mistral3ForConditionalGeneration``
models, with a Mistral language model (Mistral Small 3.x) and with a Ministral 3 one (YaRN, queries scaled by
position), written as convert_hf_to_gguf.py writes them: the language model as its Mistral3Model does (arch
``mistral3``, q/k rows permuted for llama.cpp's rotary; Ministral 3's YaRN ``mscale_all_dim`` as
``rope.scaling.yarn_log_multiplier`` and its ``llama_4_scaling_beta`` as ``attention.temperature_scale``), the tower
and projector as its LlavaVisionModel ``--mmproj`` does (projector ``pixtral``: gguf-py's names, the tower's q/k rows
permuted too, ``spatial_merge_size``; for Mistral Small, the ``[IMG_BREAK]`` embedding row copied in, as from
Mistral's own format). The pair serves text, one-image and two-image prompts token for token like the safetensors
original, the language model's file alone serves as a text model; and the errors for an incomplete mmproj.
Checked once against the real converter (llama.cpp in llama-cpp-python 0.3.36) on the same tiny models: the same
metadata and tensors but ``general.*`` and that row (see docs/multimodal.md)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from helpers import make_engine, run
from test_gguf import finish, llama_permute
from test_gguf_vl import (PROMPTS, _tokenizer, assert_serves_like_the_original, converted_tensors, f32_mmproj_writer,
                         vision_tower_metadata)
from test_vl_families import make_processor
from transformers import AutoConfig
from vl_models import MISTRAL3_VISION, save_tiny_vl_model

from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

LANGUAGE_MODEL = 'language_model.'
VISION_PREFIXES = ('vision_tower.', 'multi_modal_projector.')
ROTATED = ('q_proj.weight', 'k_proj.weight')
PROJECTIONS = tuple(f'.{name}.weight' for name in ('attn_q', 'attn_k', 'attn_v', 'attn_output', 'ffn_gate', 'ffn_up',
                                                   'ffn_down'))


def write_mistral3_gguf(model_dir: str, out: Path, arch: str = 'mistral3') -> None:
    """The language model as convert_hf_to_gguf.py's Mistral3Model writes it (float32); ``arch`` ``llama``: as older
    converters wrote Mistral Small 3.x's, the same keys under the name of Llama."""
    text = AutoConfig.from_pretrained(model_dir).text_config
    rope = text.rope_parameters
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    if rope['rope_type'] == 'yarn':
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope['factor'])
        writer.add_rope_scaling_orig_ctx_len(rope['original_max_position_embeddings'])
        writer.add_rope_scaling_yarn_beta_fast(rope['beta_fast'])
        writer.add_rope_scaling_yarn_beta_slow(rope['beta_slow'])
    writer.add_rope_freq_base(rope['rope_theta'])
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(text.vocab_size)
    writer.add_rope_dimension_count(text.head_dim)
    if text.model_type == 'ministral3':
        writer.add_rope_scaling_yarn_log_mul(rope['mscale_all_dim'])
        writer.add_attn_temperature_scale(rope['llama_4_scaling_beta'])
    _tokenizer(model_dir, writer)
    if text.pad_token_id is not None:  # Ministral 3's config names one
        writer.add_pad_token_id(text.pad_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, text.num_hidden_layers)  # the names of mistral3's too
    heads = {'q_proj.weight': text.num_attention_heads, 'k_proj.weight': text.num_key_value_heads}
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if not name.startswith(LANGUAGE_MODEL):
            continue
        data = value.numpy()
        if name.endswith(ROTATED):
            data = llama_permute(data, heads[name[-len('q_proj.weight'):]])
        writer.add_tensor(names.get_name(name.removeprefix(LANGUAGE_MODEL), try_suffixes=('.weight', '.bias')),
                          np.ascontiguousarray(data))
    finish(writer)


def write_pixtral_mmproj(model_dir: str, out: Path, skip_key: str | None = None, img_break_row: bool = False) -> None:
    """The tower and projector as convert_hf_to_gguf.py ``--mmproj --outtype f32`` (LlavaVisionModel) writes them;
    ``skip_key``: a metadata key left out; ``img_break_row``: with the ``[IMG_BREAK]`` embedding row, as it writes
    it from Mistral's own checkpoint format (from transformers' layout it does not)."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    writer = f32_mmproj_writer(out)
    processor = json.loads(Path(model_dir, 'preprocessor_config.json').read_text())
    metadata = vision_tower_metadata(writer, vision, config.text_config.hidden_size, processor['image_mean'],
                                     processor['image_std'])
    metadata['spatial_merge_size'] = (writer.add_vision_spatial_merge_size, config.spatial_merge_size)
    writer.add_clip_projector_type(gguf.VisionProjectorType.PIXTRAL)
    writer.add_vision_attention_layernorm_eps(1e-5)  # transformers' Pixtral norms, not in its config
    if vision.hidden_act == 'silu':
        writer.add_vision_use_silu(True)
    else:
        writer.add_vision_use_gelu(True)
    for key, (add, value) in metadata.items():
        if key != skip_key:
            add(value)
    tokens = json.loads(Path(model_dir, 'tokenizer.json').read_text())['added_tokens']
    img_break = next(t['id'] for t in tokens if t['content'] == '[IMG_BREAK]')
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if img_break_row and name == f'{LANGUAGE_MODEL}model.embed_tokens.weight':
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK], value[img_break].numpy())
        if not name.startswith(VISION_PREFIXES):
            continue
        data = value.numpy()
        if name.startswith('vision_tower.') and name.endswith(ROTATED):
            data = llama_permute(data, vision.num_attention_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data))
    finish(writer)


def save_tiny_mistral3(kind: str, path: str) -> str:
    # llama.cpp's map names the projector's linear_2 as block 2 of the tower (mm.2): it needs 3 layers or more
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(MISTRAL3_VISION, 'num_hidden_layers', 3)
        return save_tiny_vl_model(kind, path)


@pytest.fixture(scope='module', params=['mistral3', 'mistral3_ministral3'])
def mistral3(request, tmp_path_factory) -> str:
    return save_tiny_mistral3(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def gguf_pair(mistral3, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_mistral3_gguf(mistral3, folder / 'Mistral3-tiny-F32.gguf')
    mistral_small = AutoConfig.from_pretrained(mistral3).text_config.model_type == 'mistral'
    write_pixtral_mmproj(mistral3, folder / 'mmproj-Mistral3-tiny-F32.gguf', img_break_row=mistral_small)
    return folder


def test_gguf_pair_serves_image_prompts_like_the_original(mistral3, gguf_pair):
    model = str(gguf_pair / 'Mistral3-tiny-F32.gguf')
    folder = resolve_gguf(model)
    config, original_config = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(mistral3)
    assert config.architectures == ['Mistral3ForConditionalGeneration']
    assert config.text_config.model_type == original_config.text_config.model_type
    assert config.text_config.rope_parameters == original_config.text_config.rope_parameters
    original = load_file(f'{mistral3}/model.safetensors')
    converted = converted_tensors(folder)
    assert converted.keys() == {name.removeprefix(LANGUAGE_MODEL) for name in original}
    assert all(torch.equal(converted[name.removeprefix(LANGUAGE_MODEL)], value) for name, value in original.items())
    assert_serves_like_the_original(mistral3, model, folder)


def test_language_model_file_alone_serves_text(mistral3, gguf_pair, tmp_path):
    """Without its mmproj the file is the language model: Ministral 3's or Mistral's, the original's text tokens."""
    model = tmp_path / 'model.gguf'
    shutil.copy(gguf_pair / 'Mistral3-tiny-F32.gguf', model)
    text_model_type = AutoConfig.from_pretrained(mistral3).text_config.model_type
    config = AutoConfig.from_pretrained(resolve_gguf(str(model)))
    assert config.architectures == [{'ministral3': 'Ministral3ForCausalLM',
                                     'mistral': 'MistralForCausalLM'}[text_model_type]]
    prompts = [list(range(3, 40)), list(range(100, 190, 3))]  # both past the query scale's first step of 16
    assert run(make_engine(str(model)), prompts) == run(make_engine(mistral3), prompts)


def test_q8_0_language_model_keeps_its_blocks(mistral3, tmp_path, monkeypatch):
    """A Q8_0 language model (gguf-py's quantization of its projections) keeps them as blocks, its q/k rows put back
    in transformers' order, and gives the greedy tokens of the same pair dequantized, on text and image prompts."""
    add_tensor = gguf.GGUFWriter.add_tensor

    def quantized(writer, name, tensor, *args, **kwargs):
        if name.startswith('blk.') and name.endswith(PROJECTIONS):
            return add_tensor(writer, name, gguf.quants.quantize(tensor, Q.Q8_0), raw_dtype=Q.Q8_0)
        return add_tensor(writer, name, tensor, *args, **kwargs)

    model = tmp_path / 'Mistral3-tiny-Q8_0.gguf'
    write_pixtral_mmproj(mistral3, tmp_path / 'mmproj-Mistral3-tiny-F32.gguf')
    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, 'add_tensor', quantized)
        write_mistral3_gguf(mistral3, model)
    served = resolve_gguf(str(model))
    layers = json.loads(Path(served, 'config.json').read_text())['quantization_config']['ggml_types']
    assert layers == {f'layers.{i}.{name}': 'Q8_0' for i in range(2)
                      for name in ('self_attn.qkv_proj', 'self_attn.o_proj', 'mlp.gate_up_proj', 'mlp.down_proj')}
    convert_gguf(str(model), str(tmp_path / 'dequantized'), raw_types=())
    prompts = [make_processor(served).process(prompt) for prompt in PROMPTS]
    outs = run(make_engine(served), prompts)
    assert run(make_engine(str(tmp_path / 'dequantized')), prompts) == outs
    assert outs[1] != outs[2], 'the images must change the answer'


def test_mistral_small_as_a_llama_file_pairs_too(tmp_path):
    """Older converters wrote Mistral Small 3.x's language model as arch ``llama``: beside a pixtral mmproj it is
    Mistral 3's language model all the same."""
    original = save_tiny_mistral3('mistral3', str(tmp_path / 'mistral3'))
    model = tmp_path / 'gguf' / 'Mistral-Small-tiny-F32.gguf'
    model.parent.mkdir()
    write_mistral3_gguf(original, model, arch='llama')
    write_pixtral_mmproj(original, model.parent / 'mmproj-Mistral-Small-tiny-F32.gguf')
    folder = resolve_gguf(str(model))
    assert AutoConfig.from_pretrained(folder).text_config.model_type == 'mistral'
    assert_serves_like_the_original(original, str(model), folder)


def test_incomplete_mmproj(mistral3, gguf_pair, tmp_path):
    model = tmp_path / 'model.gguf'
    shutil.copy(gguf_pair / 'Mistral3-tiny-F32.gguf', model)
    mmproj = tmp_path / 'mmproj-model-f32.gguf'
    write_pixtral_mmproj(mistral3, mmproj, skip_key='spatial_merge_size')
    with pytest.raises(ValueError, match='missing GGUF metadata: clip.vision.spatial_merge_size'):
        resolve_gguf(str(model))
    writer = gguf.GGUFWriter(str(mmproj), 'clip')  # Pixtral 12B's kind: a two-layer projector, no patch merger
    writer.add_clip_projector_type(gguf.VisionProjectorType.PIXTRAL)
    for name in ('mm.1.weight', 'mm.2.weight'):
        writer.add_tensor(name, np.zeros((4, 4), dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match="no mm.input_norm.weight, mm.patch_merger.weight .*Pixtral 12B's"):
        resolve_gguf(str(model))
