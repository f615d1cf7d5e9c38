"""GLM-4.7-Flash from GGUF: llama.cpp's converter writes ``Glm4MoeLiteForCausalLM`` as ``deepseek2`` (MLA, sigmoid
routing), its next-token-prediction layer appended past the decoder's with ``nextn_predict_layers`` set; the
engine serves the decoder's layers alone, token for token like transformers on the original model."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_deepseek import YARN
from test_gguf import _add_tokenizer, finish
from test_gguf_archs import converter_tensors, write_metadata
from test_gguf_glm4moe import NEXTN_TENSORS
from test_glm4_moe_lite import VARIANTS, glm4_moe_lite_config

from lmdeploy.pytorch.weights.gguf import convert_gguf


def write_glm47_flash_gguf(hf, path: Path) -> None:
    """``hf`` as Glm4MoeLiteModel (a DeepseekV2Model) writes it, with one next-token-prediction layer: a copy of
    the last layer plus its ``nextn.*`` tensors (named as ``glm4moe`` names them; this gguf-py's ``deepseek2`` map
    lacks them)."""
    config, layers = hf.config, hf.config.num_hidden_layers
    writer = gguf.GGUFWriter(str(path), 'deepseek2')
    vocab = _add_tokenizer(writer)
    assert vocab == config.vocab_size
    # the keys DeepseekV2Model writes (``first_k_dense_replace`` is 1: GLM-4.7-Flash's first layer is dense)
    write_metadata(SimpleNamespace(**{**config.to_dict(), 'model_type': 'deepseek_v3', 'first_k_dense_replace': 1,
                                      'num_hidden_layers': layers + 1}), writer)
    writer.add_nextn_predict_layers(1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, layers + 1)
    nextn_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers + 1)
    tensors = converter_tensors(hf, 'deepseek_v3', {})
    tensors.update({name.replace(f'layers.{layers - 1}.', f'layers.{layers}.'): data.copy()
                    for name, data in tensors.items() if name.startswith(f'model.layers.{layers - 1}.')})
    rng = np.random.default_rng(0)
    for name, data in tensors.items():
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data))
    for name in NEXTN_TENSORS:
        shape = (config.hidden_size, 2 * config.hidden_size) if name == 'eh_proj.weight' else (config.hidden_size,)
        writer.add_tensor(nextn_names.get_name(f'model.layers.{layers}.{name}', try_suffixes=('.weight',)),
                          rng.standard_normal(shape, dtype=np.float32))
    finish(writer)


def test_gguf_glm47_flash_serves_the_decoder_layers_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    probe = gguf.GGUFWriter(str(tmp_path / 'probe.gguf'), 'deepseek2')
    config = glm4_moe_lite_config(rope_parameters=YARN, **VARIANTS['flash'])
    config.vocab_size = _add_tokenizer(probe)
    hf = hf_causal_lm(save_random_model(config, str(tmp_path / 'hf'), std={'e_score_correction_bias': 0.1}))
    src = tmp_path / 'model.gguf'
    write_glm47_flash_gguf(hf, src)

    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = json.loads((tmp_path / 'converted' / 'config.json').read_text())
    assert converted['num_hidden_layers'] == config.num_hidden_layers
    prompts = random_prompts([5, 23, 41], vocab=config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))
