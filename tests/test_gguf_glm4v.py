"""GLM-4.1V and GLM-4.5V from llama.cpp's two files: a ``glm4`` (GLM-4.1V: q/k rotary rows reordered from GLM's
pairs into halves for llama.cpp's M-RoPE) or ``glm4moe`` (GLM-4.5V) language model with its M-RoPE bands, and an
mmproj of projector ``glm4v``, written as convert_hf_to_gguf.py writes them (float32) from a tiny random model saved
by transformers: the converted folder holds the original's tower and merger, and the pair serves text, one-image and
two-image prompts token for token as transformers does on the original (first-step logits within 1e-3); the language
model alone serves text as transformers does; an mmproj without the merger is refused."""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_gguf import finish
from test_gguf_glm4moe import write_metadata as write_glm4moe_metadata
from test_gguf_vl import _tokenizer, converted_tensors, f32_mmproj_writer, vision_tower_metadata
from transformers import AutoConfig

from family_checks import assert_vl_matches_transformers
from glm4v_models import save_tiny_glm4v
from helpers import make_engine, run
from test_vl_families import hf_inputs
from vl_models import hf_vl_model, make_processor, random_image

from lmdeploy.pytorch.weights.gguf import resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

# sizes within both the tiny model's pixel limits and Glm4vImageProcessor's defaults (which the converted folder has)
PROMPTS = ['plain text', ('describe', random_image(1, (112, 112))),
           ('compare', [random_image(2, (84, 112)), random_image(3, (112, 84))])]
TEXT_ARCHS = {'glm4v': gguf.MODEL_ARCH.GLM4, 'glm4v_moe': gguf.MODEL_ARCH.GLM4_MOE}


def pairs_to_halves(rows: torch.Tensor, head_dim: int, rotary: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's ``Glm4Model.normal_to_neox``: each head's first ``rotary`` rows, even ones first."""
    heads = rows.reshape(-1, head_dim, *rows.shape[1:])
    rot = heads[:, :rotary]
    return torch.cat((rot[:, 0::2], rot[:, 1::2], heads[:, rotary:]), dim=1).reshape(rows.shape)


def write_text_gguf(model_dir: str, out: Path) -> None:
    """The language model as Glm4Model (GLM-4.1V: q/k rows reordered) or Glm4MoeModel (GLM-4.5V: stacked experts)
    writes it, with the M-RoPE bands it adds from ``mrope_section``."""
    config = AutoConfig.from_pretrained(model_dir)
    text = config.text_config
    moe = config.model_type == 'glm4v_moe'
    head_dim = getattr(text, 'head_dim', None) or text.hidden_size // text.num_attention_heads
    rotary = int(head_dim * text.rope_parameters['partial_rotary_factor'])
    arch = TEXT_ARCHS[config.model_type]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    if moe:
        write_glm4moe_metadata(SimpleNamespace(**(text.to_dict() | {'head_dim': head_dim, 'num_nextn_predict_layers': 0})),
                               writer)
    else:
        for add, value in [(writer.add_block_count, text.num_hidden_layers),
                           (writer.add_context_length, text.max_position_embeddings),
                           (writer.add_embedding_length, text.hidden_size),
                           (writer.add_feed_forward_length, text.intermediate_size),
                           (writer.add_head_count, text.num_attention_heads),
                           (writer.add_head_count_kv, text.num_key_value_heads),
                           (writer.add_key_length, head_dim), (writer.add_value_length, head_dim),
                           (writer.add_rope_freq_base, text.rope_parameters['rope_theta']),
                           (writer.add_rope_dimension_count, rotary),
                           (writer.add_layer_norm_rms_eps, text.rms_norm_eps)]:
            add(value)
    writer.add_rope_dimension_sections([*text.rope_parameters['mrope_section'], 0])
    _tokenizer(model_dir, writer)
    names = gguf.get_tensor_name_map(arch, text.num_hidden_layers)
    experts: dict[str, list] = {}
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if name.startswith('model.visual.'):
            continue
        name = name.replace('model.language_model.', 'model.')
        if not moe and name.endswith(('q_proj.weight', 'q_proj.bias', 'k_proj.weight', 'k_proj.bias')):
            value = pairs_to_halves(value, head_dim, rotary)
        expert = name.split('.mlp.experts.')
        if len(expert) == 2:  # per-expert tensors, stacked per projection as the converter does
            experts.setdefault(f'{expert[0]}.mlp.experts.{expert[1].split(".", 1)[1]}', []).append(value)
            continue
        if name.endswith('e_score_correction_bias'):
            name = name.replace('_bias', '.bias')
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), value.contiguous().numpy())
    for name, values in experts.items():
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', )), torch.stack(values).numpy())
    finish(writer)


def write_mmproj(model_dir: str, out: Path, skip: str | None = None) -> None:
    """The tower and merger as convert_hf_to_gguf.py ``--mmproj --outtype f32`` (Glm4VVisionModel) writes them: q/k/v
    fused, the Conv3d patch embedding as two Conv2d halves, no merge size; ``skip``: a tensor left out."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    writer = f32_mmproj_writer(out)
    tower = SimpleNamespace(**vision.to_dict(), num_hidden_layers=vision.depth, num_attention_heads=vision.num_heads)
    processor = make_processor(model_dir).image_inputs.image_processor
    for add, value in vision_tower_metadata(writer, tower, config.text_config.hidden_size,
                                            list(processor.image_mean), list(processor.image_std)).values():
        add(value)
    writer.add_clip_projector_type(gguf.VisionProjectorType.GLM4V)
    writer.add_vision_use_silu(True)
    writer.add_vision_attention_layernorm_eps(vision.rms_norm_eps)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if not name.startswith('model.visual.') or (skip and name.endswith(skip)):
            continue
        name = name.removeprefix('model.')
        if name == 'visual.patch_embed.proj.weight':
            writer.add_tensor(f'{patch}.weight', value[:, :, 0].contiguous().numpy())
            writer.add_tensor(f'{patch}.weight.1', value[:, :, 1].contiguous().numpy())
        elif name == 'visual.patch_embed.proj.bias':
            writer.add_tensor(f'{patch}.bias', value.numpy())
        else:
            writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(value))
    finish(writer)


@pytest.fixture(scope='module', params=['glm4v', 'glm4v_moe'])
def glm4v(request, tmp_path_factory) -> str:
    return save_tiny_glm4v(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def gguf_pair(glm4v, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_text_gguf(glm4v, folder / 'GLM-4V-tiny-F32.gguf')
    write_mmproj(glm4v, folder / 'mmproj-GLM-4V-tiny-F32.gguf')
    return folder


@pytest.mark.slow
def test_gguf_pair_serves_image_prompts_like_transformers(glm4v, gguf_pair):
    model = str(gguf_pair / 'GLM-4V-tiny-F32.gguf')
    folder = resolve_gguf(model)
    config, original_config = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(glm4v)
    assert config.model_type == original_config.model_type
    assert config.vision_config.spatial_merge_size == 2
    assert config.text_config.rope_parameters['mrope_section'] == original_config.text_config.rope_parameters[
        'mrope_section']
    original = {name: value for name, value in load_file(f'{glm4v}/model.safetensors').items()
                if name.startswith('model.visual.')}
    converted = {name: value for name, value in converted_tensors(folder).items() if name.startswith('model.visual.')}
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], value) for name, value in original.items())
    prompts = [make_processor(glm4v).process(prompt) for prompt in PROMPTS]
    from_gguf = [make_processor(folder).process(prompt) for prompt in PROMPTS]
    assert [p.input_ids for p in from_gguf] == [p.input_ids for p in prompts]
    for ours, theirs in zip(from_gguf, prompts):
        for image, reference in zip(ours.multimodal, theirs.multimodal):
            assert all(torch.equal(image.data[key], reference.data[key]) for key in reference.data)
    hf_model = hf_vl_model(glm4v)
    outs = assert_vl_matches_transformers(model, hf_model, from_gguf, [hf_inputs(hf_model, p) for p in prompts])
    assert outs[1] != outs[2], 'the images must change the answer'


def test_an_mmproj_without_the_merger_is_refused(glm4v, gguf_pair, tmp_path):
    shutil.copy(gguf_pair / 'GLM-4V-tiny-F32.gguf', tmp_path / 'model.gguf')
    write_mmproj(glm4v, tmp_path / 'mmproj-model.gguf', skip='merger.proj.weight')
    with pytest.raises(ValueError, match=r'the glm4v mmproj needs mm\.model\.fc\.weight'):
        resolve_gguf(str(tmp_path / 'model.gguf'))


@pytest.mark.slow
def test_the_language_model_alone_serves_text_like_transformers(glm4v, gguf_pair, tmp_path):
    """Without an mmproj beside it the file is a text model (GLM-4.1V's q/k rows back in pairs there too): a text
    prompt's greedy tokens are transformers' on the original."""
    shutil.copy(gguf_pair / 'GLM-4V-tiny-F32.gguf', tmp_path / 'model.gguf')
    assert AutoConfig.from_pretrained(resolve_gguf(str(tmp_path / 'model.gguf'))).model_type in ('glm4', 'glm4_moe')
    prompt = make_processor(glm4v).process(PROMPTS[0])
    hf_model = hf_vl_model(glm4v)
    expected = hf_model.generate(**hf_inputs(hf_model, prompt), max_new_tokens=32, do_sample=False, top_k=None,
                                 top_p=None, temperature=None)[0, len(prompt.input_ids):].tolist()
    assert run(make_engine(str(tmp_path / 'model.gguf')), [prompt.input_ids]) == [expected]
