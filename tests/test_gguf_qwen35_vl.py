"""Qwen3.5 and Qwen3.5-MoE with images from llama.cpp's two GGUF files: a tiny random ``Qwen3_5(Moe)ForConditional
Generation`` written as convert_hf_to_gguf.py writes it (the language model as ``qwen35``/``qwen35moe``, see
test_gguf_qwen3_next.py; with ``--mmproj``, the tower as Qwen3-VL's projector ``qwen3vl_merger`` without deepstack
layers) served as a vision-language model, token for token like the safetensors original on text and image
prompts."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from safetensors.torch import load_file
from test_gguf_qwen3_next import write_text_model
from test_gguf_qwen3vl import write_qwen3vl_mmproj
from test_gguf_vl import _tokenizer, assert_serves_like_the_original
from transformers import AutoConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vl_models import QWEN3_5_VISION, save_tiny_vl_model

from lmdeploy.pytorch.weights.gguf import resolve_gguf
from lmdeploy.pytorch.weights.gguf_vl.qwen3 import QWEN3_PIXELS

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

VARIANTS = {'qwen3_5': 'qwen35', 'qwen3_5_moe': 'qwen35moe'}


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def qwen3_5_vl(request, tmp_path_factory) -> str:
    # llama.cpp's map names the merger's layers as blocks of the tower: a depth of 3 or more; the hub's image
    # processor (the mmproj carries no pixel limits)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(QWEN3_5_VISION, 'depth', 3)
        path = save_tiny_vl_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                             size=QWEN3_PIXELS).save_pretrained(path)
    return path


def write_language_model(model_dir: str, out: Path) -> None:
    """The language model as Qwen3_5TextModel (Qwen3_5MoeTextModel) writes it (float32): the checkpoint's
    ``model.language_model.*`` as ``model.*``, the tower left to the mmproj."""
    config = AutoConfig.from_pretrained(model_dir)
    variant = VARIANTS[config.model_type]
    text = {name.replace('model.language_model.', 'model.'): value
            for name, value in load_file(f'{model_dir}/model.safetensors').items()
            if not name.startswith('model.visual.')}
    writer = gguf.GGUFWriter(str(out), variant)
    _tokenizer(model_dir, writer)
    write_text_model(writer, text, config.text_config, variant)


def test_gguf_pair_serves_image_prompts_like_the_original(qwen3_5_vl: str, tmp_path: Path) -> None:
    """The pair converts to the hub's vision-language model (its hybrid text config, rotary included) and answers
    text and image prompts as the original does."""
    model = tmp_path / 'Qwen3.5-tiny-F32.gguf'
    write_language_model(qwen3_5_vl, model)
    write_qwen3vl_mmproj(qwen3_5_vl, tmp_path / 'mmproj-Qwen3.5-tiny-F32.gguf')
    folder = resolve_gguf(str(model))
    converted = json.loads(Path(folder, 'config.json').read_text())
    original = AutoConfig.from_pretrained(qwen3_5_vl).to_dict()
    assert converted['architectures'] == original['architectures']
    for field in ('model_type', 'layer_types', 'linear_num_value_heads', 'linear_value_head_dim', 'rope_parameters'):
        assert converted['text_config'][field] == original['text_config'][field], field
    assert_serves_like_the_original(qwen3_5_vl, str(model), folder)
