"""Apertus from GGUF (llama.cpp's ``apertus``): a tiny random transformers model written as convert_hf_to_gguf.py's
ApertusModel writes it (LlamaModel's keys with q/k rows left as they are, the norms as ``attn_norm``/``ffn_norm``, the
llama3 rotary as ``rope_freqs``, each layer's xIELU ``alpha_p``/``alpha_n``/``beta``/``eps`` as the metadata arrays
``xielu.*``), read back into the original tensors and served token for token like transformers on the original model;
Q8_0 projections served as their blocks; one xIELU value for every layer, and a file without them, refused."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import save_random_model
from family_checks import assert_first_logits_close, hf_last_logits
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_apertus import apertus_config
from test_gguf import _add_tokenizer, finish
from test_gguf_arcee import assert_q8_0_attention_and_down_served_as_blocks
from test_gguf_cohere2_exaone4 import llama3_divisors
from test_gguf_llama_like import converted_model, converter_arrays

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf

XIELU = ('alpha_n', 'alpha_p', 'beta', 'eps')


def save_gguf(path: Path, quantize: bool, xielu: str = 'per_layer') -> tuple[Path, str, int]:
    """A tiny random Apertus saved in ``path / 'hf'`` and written to ``path / 'model.gguf'`` with its xIELU parameters
    ``per_layer`` (the converter's arrays), as one ``scalar`` each (layer 0's), ``short`` (arrays of layer 0's alone)
    or ``absent``: the file, the folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.APERTUS])
    vocab = _add_tokenizer(writer)
    folder = save_random_model(apertus_config(vocab_size=vocab), str(path / 'hf'))
    config = AutoConfig.from_pretrained(folder)
    head_dim = config.hidden_size // config.num_attention_heads
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps), (writer.add_vocab_size, vocab),
                       (writer.add_rope_dimension_count, head_dim)]:
        add(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.APERTUS, config.num_hidden_layers)
    values = {name: [] for name in XIELU}
    for name, data in converter_arrays(folder, config, quantize).items():
        kind = name.rpartition('.')[2]
        if '.act_fn.' in name:  # as the converter collects them: float(tensor), a value a layer
            values[kind].append(float(data.reshape(())))
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data),
                          raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    for kind, layers in values.items():
        key = getattr(gguf.Keys.xIELU, kind.upper())
        if xielu == 'per_layer':
            writer.add_array(key, layers)
        elif xielu == 'scalar':
            writer.add_float32(key, layers[0])
        elif xielu == 'short':
            writer.add_array(key, layers[:1])
    writer.add_tensor('rope_freqs.weight',
                      llama3_divisors(SimpleNamespace(rope_parameters=config.rope_parameters, head_dim=head_dim)))
    finish(writer)
    return src, folder, vocab


def test_gguf_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's own xIELU parameters come back bit for bit; 32 greedy tokens of three prompts and the first-step
    logits within 1e-3 of transformers on the original model."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(tmp_path, quantize=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    alphas = [hf.model.layers[i].mlp.act_fn.alpha_p.item() for i in range(hf.config.num_hidden_layers)]
    assert alphas[0] != alphas[1]  # a value per layer, not one for all

    converted = converted_model(src, tmp_path, hf)
    assert converted.config.rope_parameters.items() >= hf.config.rope_parameters.items()

    prompts = random_prompts([5, 23, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))
    assert_first_logits_close(make_engine(str(src)), prompts, [hf_last_logits(hf, p) for p in prompts])


def test_gguf_q8_0_kept_as_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's and the down projections in Q8_0 are served as their blocks; the ungated up projection is
    dequantized (the GGUF block tables know gated MLPs only); token for token like transformers on the weights the
    blocks hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    assert_q8_0_attention_and_down_served_as_blocks(*save_gguf(tmp_path, quantize=True))


def test_one_xielu_value_for_every_layer(tmp_path: Path) -> None:
    """A file with one value per ``xielu.*`` key (as llama.cpp reads it too) gives every layer that value."""
    src, folder, _ = save_gguf(tmp_path, quantize=False, xielu='scalar')
    out = tmp_path / 'converted'
    convert_gguf(str(src), str(out))
    shards = json.loads((out / 'model.safetensors.index.json').read_text())['weight_map']
    original = load_file(str(Path(folder) / 'model.safetensors'))
    for layer in range(AutoConfig.from_pretrained(folder).num_hidden_layers):
        for kind in XIELU:
            name = f'model.layers.{layer}.mlp.act_fn.{kind}'
            torch.testing.assert_close(load_file(str(out / shards[name]))[name],
                                       original[f'model.layers.0.mlp.act_fn.{kind}'], rtol=0, atol=0)


@pytest.mark.parametrize('xielu, message', [
    ('absent', 'missing GGUF metadata: xielu.alpha_p, xielu.alpha_n, xielu.beta, xielu.eps'),
    ('short', r'GGUF metadata xielu.alpha_p \(1\), .* should hold one value per layer \(2\)')])
def test_file_without_each_layers_xielu_is_refused(xielu: str, message: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A clear error naming the keys, and no converted folder left."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, _, _ = save_gguf(tmp_path, quantize=False, xielu=xielu)
    with pytest.raises(ConfigError, match=message):
        resolve_gguf(str(src))
    assert not any((tmp_path / 'cache' / 'gguf').glob('*'))
