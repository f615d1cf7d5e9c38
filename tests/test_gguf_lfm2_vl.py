"""LFM2-VL from llama.cpp's two files: an ``lfm2`` language model and an mmproj of projector ``lfm2``, written as
convert_hf_to_gguf.py writes them (float32) from a tiny random LFM2-VL with the released checkpoints' tower geometry
(16 px patches, 2 x 2 unshuffle) and tiling (transformers' defaults, which the files do not hold): the converted
folder holds the original's tensors, and the pair serves text and image prompts (a tiled one among them) as the
original does."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file
from test_gguf import finish
from test_gguf_lfm2 import file_tensors, write_metadata
from test_gguf_vl import _tokenizer, converted_tensors, f32_mmproj_writer, vision_tower_metadata
from test_lfm2_vl import VISION, save_tiny_lfm2_vl
from transformers import AutoConfig
from vl_models import make_processor, random_image

from helpers import make_engine, run
from lmdeploy.pytorch.weights.gguf import resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

RELEASED = {'image_processor_type': 'Lfm2VlImageProcessor'}  # transformers' defaults: 512 px tiles, 64 to 256 tokens
# smart-resized alone (upscaled to 64 tokens), and cut into 2 x 1 tiles of 512 px plus the thumbnail
PROMPTS = ['plain text', ('describe', random_image(1, (40, 30))), ('describe', random_image(2, (1100, 600)))]


def write_lfm2_gguf(model_dir: str, out: Path) -> None:
    """The language model as convert_hf_to_gguf.py's LFM2Model writes it (float32)."""
    text = AutoConfig.from_pretrained(model_dir).text_config
    writer = gguf.GGUFWriter(str(out), 'lfm2')
    write_metadata(text, writer, 'lfm2')
    _tokenizer(model_dir, writer)
    language = {name.replace('model.language_model.', 'model.'): value
                for name, value in load_file(f'{model_dir}/model.safetensors').items()
                if name.startswith('model.language_model.')}
    for name, data in file_tensors(SimpleNamespace(state_dict=lambda: language), False).items():
        writer.add_tensor(name, data)
    finish(writer)


def write_lfm2_mmproj(model_dir: str, out: Path, skip: str | None = None) -> None:
    """The tower and projector as convert_hf_to_gguf.py ``--mmproj --outtype f32`` (LFM2VLModel) writes them from the
    hub's names (``model.vision_tower.vision_model.*``): the patch embedding as a convolution's weight; ``skip``: a
    tensor left out."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    writer = f32_mmproj_writer(out)
    tower = SimpleNamespace(**vision.to_dict(), image_size=256)  # the converter's fixed image size
    for add, value in vision_tower_metadata(writer, tower, config.text_config.hidden_size, [0.5] * 3,
                                            [0.5] * 3).values():
        add(value)
    writer.add_clip_projector_type(gguf.VisionProjectorType.LFM2)
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_projector_scale_factor(config.downsample_factor)
    writer.add_vision_use_gelu(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision.num_hidden_layers, 3))
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if not name.startswith(('model.vision_tower.', 'model.multi_modal_projector.')):
            continue
        hub_name = name.replace('model.vision_tower.', 'vision_tower.vision_model.').removeprefix('model.')
        data = value
        if skip and name.endswith(skip):
            continue
        if name.endswith('patch_embedding.weight'):
            patch = vision.patch_size
            data = value.view(value.shape[0], patch, patch, 3).permute(0, 3, 1, 2)
        writer.add_tensor(names.get_name(hub_name, try_suffixes=('.weight', '.bias')), data.contiguous().numpy())
    finish(writer)


@pytest.fixture(scope='module')
def lfm2_vl(tmp_path_factory) -> str:
    return save_tiny_lfm2_vl(str(tmp_path_factory.mktemp('lfm2_vl')), VISION | {'patch_size': 16}, RELEASED)


@pytest.fixture(scope='module')
def gguf_pair(lfm2_vl, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_lfm2_gguf(lfm2_vl, folder / 'LFM2-VL-tiny-F32.gguf')
    write_lfm2_mmproj(lfm2_vl, folder / 'mmproj-LFM2-VL-tiny-F32.gguf')
    return folder


@pytest.mark.slow
def test_gguf_pair_serves_image_prompts_like_the_original(lfm2_vl, gguf_pair):
    model = str(gguf_pair / 'LFM2-VL-tiny-F32.gguf')
    folder = resolve_gguf(model)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == 'lfm2_vl' and config.downsample_factor == 2
    original = {name.removeprefix('model.'): value for name, value in load_file(f'{lfm2_vl}/model.safetensors').items()
                if not name.startswith('model.language_model.')}
    converted = {name: value for name, value in converted_tensors(folder).items()
                 if name.startswith(('vision_tower.', 'multi_modal_projector.'))}
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], value) for name, value in original.items())
    prompts = [make_processor(lfm2_vl).process(prompt) for prompt in PROMPTS]
    from_gguf = [make_processor(folder).process(prompt) for prompt in PROMPTS]
    assert [p.input_ids for p in from_gguf] == [p.input_ids for p in prompts]
    assert prompts[2].multimodal[0].data['tile_grid'].tolist() == [[1, 2]]
    for ours, theirs in zip(from_gguf[1:], prompts[1:]):
        assert all(torch.equal(ours.multimodal[0].data[key], value) for key, value in theirs.multimodal[0].data.items())
    expected = run(make_engine(lfm2_vl), prompts)
    assert run(make_engine(model), from_gguf) == expected
    assert expected[1] != expected[2], 'the images must change the answer'


def test_a_language_model_alone_is_text_and_an_incomplete_mmproj_is_refused(lfm2_vl, gguf_pair, tmp_path):
    alone = tmp_path / 'alone'
    alone.mkdir()
    shutil.copy(gguf_pair / 'LFM2-VL-tiny-F32.gguf', alone / 'model.gguf')
    assert AutoConfig.from_pretrained(resolve_gguf(str(alone / 'model.gguf'))).model_type == 'lfm2'
    broken = tmp_path / 'broken'
    broken.mkdir()
    shutil.copy(gguf_pair / 'LFM2-VL-tiny-F32.gguf', broken / 'model.gguf')
    write_lfm2_mmproj(lfm2_vl, broken / 'mmproj-model.gguf', skip='linear_2.weight')
    with pytest.raises(ValueError, match=r'the lfm2 mmproj needs mm\.2\.weight'):
        resolve_gguf(str(broken / 'model.gguf'))
