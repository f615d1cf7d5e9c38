"""Llama 4 with images from llama.cpp's two GGUF files: the tiny random ``Llama4ForConditionalGeneration`` of
``test_llama4_vl.py`` with the text model of ``test_gguf_llama4.py`` (what llama.cpp represents: chunks of 8192, a
NoPE layer every 4th, Scout's llama3 rotary) and a tower of depth 3 (gguf-py's map names the adapter's ``fc2`` as
block 2), its image processor at Llama 4's default of 16 tiles. The language model is written as
convert_hf_to_gguf.py's Llama4Model writes it, the tower, adapter and projector as its Llama4VisionModel
``--mmproj`` does (projector ``llama4``: gguf-py's names, ``linear_1`` as ``mm.model.fc``, the pixel shuffle as
``clip.vision.projector.scale_factor``). The pair is served token for token and with the first-step logits of
transformers on a text and a several-tile image prompt, F32 and with a Q8_0 language model; mismatched and
incomplete mmproj files are refused."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from family_checks import assert_vl_matches_transformers
from helpers import make_engine, run
from test_gguf import finish
from test_gguf_llama4 import CONFIG as LLAMA_CPP_TEXT, kept_layers, random_llama4, write_language_model
from test_gguf_vl import _tokenizer, converted_tensors, f32_mmproj_writer, vision_tower_metadata
import test_llama4_vl
from test_llama4_vl import PREPROCESSOR, PROMPTS, VISION, hf_inputs, save_tiny_llama4_vl
from test_vl_families import make_processor
from transformers import AutoConfig
from vl_models import hf_vl_model

from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf
from lmdeploy.pytorch.weights.gguf_vl.llama4 import MAX_TILES

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

LANGUAGE_MODEL = 'language_model.'
VISION_PREFIXES = ('vision_model.', 'multi_modal_projector.')
TEXT_FILE, MMPROJ_FILE = 'Llama-4-tiny.gguf', 'mmproj-Llama-4-tiny-F32.gguf'


@pytest.fixture(scope='module')
def original(tmp_path_factory) -> str:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_llama4_vl, 'TEXT_CONFIG', LLAMA_CPP_TEXT)
        patch.setitem(VISION, 'num_hidden_layers', 3)
        patch.setitem(PREPROCESSOR, 'max_patches', MAX_TILES)
        return save_tiny_llama4_vl(str(tmp_path_factory.mktemp('llama4_vl')))


def hf_model(original: str):
    return hf_vl_model(original)


def write_llama4_text_gguf(hf, model_dir: str, out: Path, qtype: Q = Q.F32) -> None:
    """``hf``'s language model as Llama4Model writes it with ``--outtype`` ``qtype``, the vocabulary and chat
    template of ``model_dir``'s tokenizer; ``hf`` takes the weights the file holds."""
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA4])
    _tokenizer(model_dir, writer)
    write_language_model(hf.language_model, writer, qtype)


def write_llama4_mmproj(model_dir: str, out: Path, post_norm: str = 'attn_post_norm',
                        skip_key: str | None = None) -> None:
    """The tower, adapter and projector as convert_hf_to_gguf.py ``--mmproj --outtype f32`` (Llama4VisionModel)
    writes them; ``post_norm``: the blocks' post-attention LayerNorm's name (``ln2`` in files converted before
    gguf-py's map took Gemma 4's name for it); ``skip_key``: a metadata key left out."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    writer = f32_mmproj_writer(out)
    processor = json.loads(Path(model_dir, 'preprocessor_config.json').read_text())
    metadata = vision_tower_metadata(writer, vision, config.text_config.hidden_size, processor['image_mean'],
                                     processor['image_std'])
    metadata['projector.scale_factor'] = (writer.add_vision_projector_scale_factor,
                                          int(1 / vision.pixel_shuffle_ratio))
    writer.add_clip_projector_type(gguf.VisionProjectorType.LLAMA4)
    writer.add_vision_attention_layernorm_eps(vision.norm_eps)
    writer.add_vision_use_gelu(True)
    for key, (add, value) in metadata.items():
        if key != skip_key:
            add(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if not name.startswith(VISION_PREFIXES):
            continue
        if name == 'multi_modal_projector.linear_1.weight':
            gguf_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_MMPROJ_FC] + '.weight'
        else:
            name += '.weight' if name.endswith('positional_embedding_vlm') else ''
            gguf_name = names.get_name(name, try_suffixes=('.weight', '.bias'))
        writer.add_tensor(gguf_name.replace('.attn_post_norm.', f'.{post_norm}.'), value.numpy())
    finish(writer)


def write_pair(original: str, folder: Path, qtype: Q = Q.F32, post_norm: str = 'attn_post_norm'):
    """The pair in ``folder``; transformers' model of the weights it holds."""
    folder.mkdir(exist_ok=True)
    hf = hf_model(original)
    write_llama4_text_gguf(hf, original, folder / TEXT_FILE, qtype)
    write_llama4_mmproj(original, folder / MMPROJ_FILE, post_norm)
    return hf


def test_f32_pair_is_the_original_and_matches_transformers(original, tmp_path):
    """The folder holds the original's config and tensors (bit for bit); its processor makes the original's ids
    and tiles; the engine gives transformers' 32 greedy tokens and first-step logits on a text prompt and an image
    of 1 x 2 tiles and the global one."""
    hf = write_pair(original, tmp_path / 'pair')
    model = str(tmp_path / 'pair' / TEXT_FILE)
    folder = resolve_gguf(model)
    config, expected = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(original)
    assert config.architectures == ['Llama4ForConditionalGeneration']
    vision, expected_vision = (c.vision_config.to_diff_dict() for c in (config, expected))
    assert vision.pop('norm_eps') == pytest.approx(expected_vision.pop('norm_eps'))  # a float32 in the file
    expected_vision.pop('dtype')
    assert vision == expected_vision
    for field in ('image_token_index', 'boi_token_index', 'eoi_token_index'):
        assert getattr(config, field) == getattr(expected, field), field
    for field in ('layer_types', 'moe_layers', 'no_rope_layers', 'attention_chunk_size', 'rope_parameters'):
        assert getattr(config.text_config, field) == getattr(expected.text_config, field), field
    tensors = converted_tensors(folder)
    state = load_file(f'{original}/model.safetensors')
    assert tensors.keys() == {name.removeprefix(LANGUAGE_MODEL) for name in state}
    assert all(torch.equal(tensors[name.removeprefix(LANGUAGE_MODEL)], value) for name, value in state.items())

    prompts = [make_processor(folder).process(prompt) for prompt in PROMPTS[:2]]
    reference = [make_processor(original).process(prompt) for prompt in PROMPTS[:2]]
    assert [p.input_ids for p in prompts] == [p.input_ids for p in reference]
    image = prompts[1].multimodal[0]
    assert image.data['aspect_ratios'].tolist() == [[1, 2]]
    assert torch.equal(image.data['pixel_values'], reference[1].multimodal[0].data['pixel_values'])
    outs = assert_vl_matches_transformers(model, hf, prompts, [hf_inputs(p) for p in prompts])
    assert len(set(outs[1])) > 2, 'the tiny model must not repeat one token'


def test_q8_0_language_model_keeps_its_blocks(original, tmp_path):
    """A Q8_0 language model keeps its projections and experts as blocks, the tower dense; with the post-attention
    norms named ``ln2`` (older converters) it gives transformers' greedy tokens on the weights the files hold, and
    gives back every block."""
    hf = write_pair(original, tmp_path / 'pair', Q.Q8_0, post_norm='ln2')
    model = str(tmp_path / 'pair' / TEXT_FILE)
    folder = resolve_gguf(model)
    types = json.loads(Path(folder, 'config.json').read_text())['quantization_config']['ggml_types']
    assert types == dict.fromkeys(kept_layers(hf.config.text_config), 'Q8_0')
    tensors = converted_tensors(folder)
    assert 'vision_model.model.layers.2.post_attention_layernorm.bias' in tensors
    assert tensors['model.layers.0.self_attn.q_proj.qweight'].dtype == torch.uint8
    prompts = [make_processor(folder).process(prompt) for prompt in PROMPTS[:2]]
    expected = [hf.generate(**hf_inputs(p), max_new_tokens=32, do_sample=False, top_k=None, top_p=None,
                            temperature=None)[0, len(p.input_ids):].tolist() for p in prompts]
    engine = make_engine(model)
    assert run(engine, prompts) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_mismatched_or_incomplete_mmproj_is_refused(original, tmp_path, tmp_gguf_cache, monkeypatch, caplog):
    """A projector of another width than the language model's, an mmproj without the pixel shuffle's step, a
    language model whose vocabulary lacks the image tokens and another family's mmproj given for the file are
    refused, saying which; another family's mmproj beside the file leaves it a text model, with a warning. Nothing
    is left in the cache."""
    write_pair(original, tmp_path / 'pair')
    model = tmp_path / 'pair' / TEXT_FILE
    mmproj = tmp_path / 'pair' / MMPROJ_FILE
    add_tensor = gguf.GGUFWriter.add_tensor

    def narrower_projector(writer, name, tensor, *args, **kwargs):
        return add_tensor(writer, name, tensor[:32] if name == 'mm.model.fc.weight' else tensor, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, 'add_tensor', narrower_projector)
        write_llama4_mmproj(original, mmproj)
    with pytest.raises(ValueError, match="the projector gives 32 features, the language model takes 64: the mmproj "
                                         "is another model's"):
        resolve_gguf(str(model))
    write_llama4_mmproj(original, mmproj, skip_key='projector.scale_factor')
    with pytest.raises(ValueError, match='missing GGUF metadata: clip.vision.projector.scale_factor'):
        resolve_gguf(str(model))
    text_only = tmp_path / 'text_only'  # a Llama 4 text model of the same width, without the image tokens
    text_only.mkdir()
    random_llama4(text_only)
    write_llama4_mmproj(original, text_only / MMPROJ_FILE)
    with pytest.raises(ValueError, match=r"the tokenizer has no <\|patch\|>, <\|image_start\|>, .* token \(Llama 4's "
                                         r"image tokens\)"):
        resolve_gguf(str(text_only / 'model.gguf'))
    other = gguf.GGUFWriter(str(mmproj), 'clip')
    other.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    finish(other)
    with pytest.raises(ValueError, match="projector 'gemma3' does not pair with a llama4 language model "
                                         r"\(expected one of: llama4\)"):
        convert_gguf(str(model), str(tmp_path / 'out'), mmproj_path=str(mmproj))
    assert not (tmp_path / 'out').exists() and not any(tmp_gguf_cache.glob('gguf/*'))
    with caplog.at_level(logging.WARNING):
        folder = resolve_gguf(str(model))
    assert "its projector 'gemma3' does not pair with a llama4 language model" in caplog.text
    assert AutoConfig.from_pretrained(folder).architectures == ['Llama4ForCausalLM']
