"""Mistral Small 4 from GGUF: llama.cpp's converter writes its language model as ``mistral4`` (``DeepseekV2Model``'s
keys and tensors: MLA's ``kv_b`` split into ``k_b``/``v_b``, the experts' ``gate_up`` kept stacked as transformers
holds it), the queries' position scale under ``attention.temperature_*``; the engine serves it token for token like
transformers on the original model."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from conftest import save_random_model
from family_checks import assert_first_logits_close, hf_causal_lm, hf_last_logits
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf import _add_tokenizer, finish
from test_gguf_archs import write_metadata
from test_mistral4 import ROPE, VARIANTS, mistral4_config

from lmdeploy.pytorch.weights.gguf import convert_gguf


def converter_tensors(hf) -> dict[str, np.ndarray]:
    """``hf``'s tensors as ``Mistral4Model`` hands them to the name map: ``.weight`` after the stacked experts,
    ``kv_b_proj`` split into ``k_b`` (transposed) and ``v_b`` per head."""
    config, out = hf.config, {}
    for name, tensor in hf.state_dict().items():
        data = tensor.numpy()
        if name.endswith(('experts.gate_up_proj', 'experts.down_proj')):
            out[f'{name}.weight'] = data
        elif name.endswith('kv_b_proj.weight'):
            kv_b = data.reshape(config.num_attention_heads, config.qk_nope_head_dim + config.v_head_dim, -1)
            out[name.replace('kv_b', 'k_b')] = kv_b[:, :config.qk_nope_head_dim].transpose(0, 2, 1)
            out[name.replace('kv_b', 'v_b')] = kv_b[:, config.qk_nope_head_dim:]
        else:
            out[name] = data
    return out


def write_mistral4_gguf(hf, path: Path, temperature: bool = True) -> None:
    """``hf`` as the converter writes it: ``deepseek2``'s keys (MLA as multi-query attention over the latent) under
    ``mistral4``, and with ``temperature`` the queries' scale and step as Mistral's converters write them."""
    config = hf.config
    writer = gguf.GGUFWriter(str(path), 'mistral4')
    assert _add_tokenizer(writer) == config.vocab_size
    write_metadata(SimpleNamespace(**{**config.to_dict(), 'model_type': 'deepseek_v2'}), writer)
    if temperature:
        writer.add_attn_temperature_scale(ROPE['llama_4_scaling_beta'])
        writer.add_attn_temperature_length(ROPE['original_max_position_embeddings'])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MISTRAL4, config.num_hidden_layers)
    for name, data in converter_tensors(hf).items():
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data))
    finish(writer)


@pytest.fixture(scope='module')
def hf_mistral4(tmp_path_factory):
    """transformers' tiny Mistral Small 4 over the GGUF test tokenizer's vocabulary."""
    tmp = tmp_path_factory.mktemp('mistral4')
    config = mistral4_config(**VARIANTS['small4'])
    config.vocab_size = _add_tokenizer(gguf.GGUFWriter(str(tmp / 'probe.gguf'), 'mistral4'))
    return hf_causal_lm(save_random_model(config, str(tmp / 'hf')))


def test_gguf_mistral4_matches_transformers(hf_mistral4, tmp_path: Path, tmp_gguf_cache) -> None:
    """Greedy tokens past the queries' first scale steps (32 positions) and the first-step logits."""
    src = tmp_path / 'model.gguf'
    write_mistral4_gguf(hf_mistral4, src)
    vocab = hf_mistral4.config.vocab_size
    prompts = random_prompts([5, 23, 70], vocab=vocab)
    assert_transformers_greedy(hf_mistral4, prompts, run(make_engine(str(src)), prompts))
    logits_prompts = random_prompts([9, 66], vocab=vocab, seed=2)
    assert_first_logits_close(make_engine(str(src)), logits_prompts,
                              [hf_last_logits(hf_mistral4, p) for p in logits_prompts])


def test_gguf_mistral4_config(hf_mistral4, tmp_path: Path, tmp_gguf_cache) -> None:
    """The converted config is transformers' Mistral 4 (softmax routing, no ``topk_method``); a file without
    ``attention.temperature_scale`` leaves the queries unscaled, as llama.cpp does."""
    src = tmp_path / 'model.gguf'
    write_mistral4_gguf(hf_mistral4, src, temperature=False)
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = json.loads((tmp_path / 'converted' / 'config.json').read_text())
    assert converted['architectures'] == ['Mistral4ForCausalLM'] and 'topk_method' not in converted
    assert converted['head_dim'] == hf_mistral4.config.head_dim
    assert converted['q_lora_rank'] == hf_mistral4.config.q_lora_rank
    assert 'llama_4_scaling_beta' not in converted['rope_parameters']
