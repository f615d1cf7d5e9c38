"""Cohere2 and EXAONE 4.0 from GGUF: a tiny random transformers model written as llama.cpp's converter writes it
(gguf-py's tensor names, the converter's metadata: Cohere2's LayerNorm epsilon, logit scale and window with the layer
step left to the loader; EXAONE 4.0's window and layer pattern, or its llama3 rotary as ``rope_freqs``), read back
into the original tensors and served token for token like transformers on the original model; Q8_0 projections
served as their blocks."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_cohere2 import save_cohere2
from test_exaone4 import save_exaone4
from test_gguf import _add_tokenizer, finish
from test_gguf_llama_like import converted_model, converter_arrays


# kind -> (how to save it, its variant, llama.cpp's architecture)
MODELS = {'cohere2': (save_cohere2, 'command_r7b', gguf.MODEL_ARCH.COHERE2),
          'exaone4_32b': (save_exaone4, 'exaone4_32b', gguf.MODEL_ARCH.EXAONE4),
          'exaone4_1_2b': (save_exaone4, 'exaone4_1_2b', gguf.MODEL_ARCH.EXAONE4)}


def llama3_divisors(config) -> np.ndarray:
    """The llama3 rotary as per-frequency divisors, as the converter writes ``rope_freqs``."""
    rope, dim = config.rope_parameters, config.head_dim
    wavelengths = 2 * np.pi * rope['rope_theta'] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    context = rope['original_max_position_embeddings']
    smooth = (context / wavelengths - rope['low_freq_factor']) / (rope['high_freq_factor'] - rope['low_freq_factor'])
    divisors = np.where(wavelengths < context / rope['high_freq_factor'], 1.0,
                        np.where(wavelengths > context / rope['low_freq_factor'], rope['factor'],
                                 1 / ((1 - smooth) / rope['factor'] + smooth)))
    return divisors.astype(np.float32)


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The keys convert_hf_to_gguf.py writes for ``config``'s family (TextModel's, then Cohere2Model's or
    Exaone4Model's)."""
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_vocab_size, config.vocab_size)]:
        add(value)
    if config.model_type == 'cohere2':
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_logit_scale(config.logit_scale)
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        return
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([kind == 'sliding_attention' for kind in config.layer_types])


def save_gguf(kind: str, path: Path, quantize: bool) -> tuple[Path, str, int]:
    """A tiny random ``kind`` saved in ``path / 'hf'`` and written to ``path / 'model.gguf'``: the file, the folder
    and the vocabulary size."""
    save, variant, arch = MODELS[kind]
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[arch])
    vocab = _add_tokenizer(writer)
    folder = save(str(path / 'hf'), variant, vocab_size=vocab)
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, data in converter_arrays(folder, config, quantize).items():
        if config.tie_word_embeddings and name == 'lm_head.weight':
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data),
                          raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    if config.rope_parameters['rope_type'] == 'llama3':
        writer.add_tensor('rope_freqs.weight', llama3_divisors(config))
    finish(writer)
    return src, folder, vocab


@pytest.mark.parametrize('kind', sorted(MODELS))
def test_gguf_matches_transformers(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path, quantize=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    converted = converted_model(src, tmp_path, hf)
    for field in ('layer_types', 'sliding_window', 'tie_word_embeddings'):
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    floats = [field for field in ('layer_norm_eps', 'logit_scale', 'rms_norm_eps') if hasattr(hf.config, field)]
    for field in floats:  # float32 in the file
        assert getattr(converted.config, field) == pytest.approx(getattr(hf.config, field), rel=1e-6), field
    assert converted.config.rope_parameters.items() >= hf.config.rope_parameters.items()

    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


@pytest.mark.parametrize('kind', ['cohere2', 'exaone4_32b'])
def test_gguf_q8_0_kept_as_blocks(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection in Q8_0 is served as its blocks, token for token like transformers on the weights those
    blocks hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path, quantize=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    for layer in range(hf.config.num_hidden_layers):
        for name in ('self_attn.qkv_proj', 'self_attn.o_proj', 'mlp.gate_up_proj', 'mlp.down_proj'):
            assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
