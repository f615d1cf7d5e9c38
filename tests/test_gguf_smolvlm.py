"""SmolVLM from llama.cpp's two GGUF files: a tiny random transformers ``SmolVLMForConditionalGeneration`` whose
language model is written as convert_hf_to_gguf.py's LlamaModel writes it (arch ``llama``, q/k rows permuted) and
whose tower and connector as its SmolVLMModel ``--mmproj`` writes them (projector ``idefics3``: gguf-py's names, the
pixel shuffle as ``clip.vision.projector.scale_factor``, the image processor's longest side as
``clip.vision.preproc_image_size``), served as ``Idefics3ForConditionalGeneration`` token for token like the
safetensors original on text, one-image and two-image prompts; and the errors for an mmproj that does not fit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_gguf import finish, llama_permute
from test_gguf_vl import (_tokenizer, assert_serves_like_the_original, converted_tensors, f32_mmproj_writer,
                         vision_tower_metadata)
from test_smolvlm import save_tiny_smolvlm
from transformers import AutoConfig

from lmdeploy.pytorch.weights.gguf import resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

TEXT_PREFIX = 'model.text_model.'


def converted_name(name: str) -> str:
    """The name a SmolVLM checkpoint's tensor has in the folder converted from its GGUF pair."""
    if name.startswith(TEXT_PREFIX):
        return 'model.' + name.removeprefix(TEXT_PREFIX)
    return name.removeprefix('model.')


def write_text_gguf(model_dir: str, out: Path) -> None:
    """The language model as convert_hf_to_gguf.py's LlamaModel writes SmolVLM's (float32)."""
    text = AutoConfig.from_pretrained(model_dir).text_config
    writer = gguf.GGUFWriter(str(out), 'llama')
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_rope_freq_base(text.rope_parameters['rope_theta'])
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_rope_dimension_count(text.hidden_size // text.num_attention_heads)
    _tokenizer(model_dir, writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, text.num_hidden_layers)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if not (name.startswith(TEXT_PREFIX) or name == 'lm_head.weight'):
            continue
        name, data = converted_name(name), value.numpy()
        if name.endswith(('q_proj.weight', 'k_proj.weight')):
            data = llama_permute(data, text.num_attention_heads if 'q_proj' in name else text.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data))
    finish(writer)


def write_smolvlm_mmproj(model_dir: str, out: Path, scale_factor: int | None = None) -> None:
    """The tower and connector as convert_hf_to_gguf.py ``--mmproj --outtype f32`` writes them; ``scale_factor``:
    another pixel shuffle written than the model's."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    writer = f32_mmproj_writer(out)
    for add, value in vision_tower_metadata(writer, vision, config.text_config.hidden_size, [0.5] * 3,
                                            [0.5] * 3).values():
        add(value)
    writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_projector_scale_factor(scale_factor or config.scale_factor)
    writer.add_vision_use_gelu(True)
    preprocessor = json.loads(Path(model_dir, 'preprocessor_config.json').read_text())
    writer.add_vision_preproc_image_size(preprocessor['size']['longest_edge'])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if name.startswith(('model.vision_model.', 'model.connector.')):
            writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), value.numpy())
    finish(writer)


@pytest.fixture(scope='module')
def smolvlm(tmp_path_factory) -> str:
    return save_tiny_smolvlm('smolvlm', str(tmp_path_factory.mktemp('smolvlm')))


@pytest.fixture(scope='module')
def gguf_pair(smolvlm, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_text_gguf(smolvlm, folder / 'SmolVLM-tiny-F32.gguf')
    write_smolvlm_mmproj(smolvlm, folder / 'mmproj-SmolVLM-tiny-F32.gguf')
    return folder


def test_gguf_pair_serves_image_prompts_like_the_original(smolvlm, gguf_pair):
    model = str(gguf_pair / 'SmolVLM-tiny-F32.gguf')
    folder = resolve_gguf(model)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == 'idefics3' and config.scale_factor == 2
    original = {converted_name(name): value for name, value in load_file(f'{smolvlm}/model.safetensors').items()}
    converted = converted_tensors(folder)
    assert converted.keys() == original.keys()
    assert all(torch.allclose(converted[name], value, rtol=0, atol=1e-6) for name, value in original.items())
    assert_serves_like_the_original(smolvlm, model, folder)


def test_mmproj_of_another_shuffle_or_without_the_projection_is_refused(smolvlm, gguf_pair, tmp_path):
    model = tmp_path / 'model.gguf'
    shutil.copy(gguf_pair / 'SmolVLM-tiny-F32.gguf', model)
    write_smolvlm_mmproj(smolvlm, tmp_path / 'mmproj-model-f32.gguf', scale_factor=4)
    with pytest.raises(ValueError, match="the connector's projection is .* the mmproj is another model's"):
        resolve_gguf(str(model))
    writer = gguf.GGUFWriter(str(tmp_path / 'mmproj-model-f32.gguf'), 'clip')
    writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    for key in ('embedding_length', 'feed_forward_length', 'block_count', 'head_count', 'image_size', 'patch_size'):
        writer.add_uint32(f'clip.vision.{"attention." if key == "head_count" else ""}{key}', 1)
    writer.add_tensor('v.post_ln.weight', np.zeros(4, dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match='needs mm.model.fc.weight'):
        resolve_gguf(str(model))
