"""Gemma 4 from GGUF (llama.cpp's ``gemma4``): the tiny random models of ``test_gemma4.py`` written as
convert_hf_to_gguf.py's Gemma4Model writes them (gguf-py's tensor names, per-layer KV heads and MLP widths, the two
head widths, the proportional rope as ``rope_freqs``, the router's and experts' scales, the layer scalars), read back
into the original tensors and served token for token like transformers on the original model."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import save_random_model
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gemma4 import STD, dense_config, moe_config
from test_gguf import _add_tokenizer, finish
from test_gguf_llama_like import converted_model

CONFIGS = {'dense': dense_config, 'moe': moe_config}


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The keys Gemma4Model writes (Gemma3Model's, then its own)."""
    layers, kinds = config.num_hidden_layers, config.layer_types
    full, sliding = (config.per_layer_config[kinds.index(kind)].head_dim for kind in ('full_attention',
                                                                                        'sliding_attention'))
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    first_shared = layers - config.num_kv_shared_layers
    wide = 2 if config.use_double_wide_mlp else 1
    writer.add_feed_forward_length([config.intermediate_size * (1 if i < first_shared else wide)
                                    for i in range(layers)])
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([config.per_layer_config[i].num_key_value_heads for i in range(layers)])
    writer.add_key_length(full)
    writer.add_value_length(full)
    writer.add_key_length_swa(sliding)
    writer.add_value_length_swa(sliding)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters['full_attention']['rope_theta'])
    writer.add_rope_freq_base_swa(config.rope_parameters['sliding_attention']['rope_theta'])
    writer.add_rope_dimension_count(full)
    writer.add_rope_dimension_count_swa(sliding)
    writer.add_sliding_window(config.sliding_window)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_vocab_size(config.vocab_size)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    writer.add_sliding_window_pattern([kind == 'sliding_attention' for kind in kinds])
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def rope_freqs(config) -> np.ndarray:
    """The converter's divisors of the full layers' frequencies: 1 for those that turn, 1e30 for the others."""
    full = config.rope_parameters['full_attention']
    head_dim = config.per_layer_config[config.layer_types.index('full_attention')].head_dim
    turning = int(head_dim * full['partial_rotary_factor'] / 2)
    return np.array([1.0] * turning + [1e30] * (head_dim // 2 - turning), dtype=np.float32)


def converter_name(name: str, names) -> str:
    """The file's name of a checkpoint tensor, as Gemma4Model's ``filter_tensors`` and ``modify_tensors`` give it."""
    block = name.split('.')[2] if name.startswith('model.layers.') else None
    if name.endswith('router.scale'):
        return f'blk.{block}.ffn_gate_inp.scale'
    if name.endswith('router.per_expert_scale'):
        return f'blk.{block}.ffn_down_exps.scale'
    if name.endswith(('layer_scalar', '.experts.gate_up_proj', '.experts.down_proj')):
        name += '.weight'
    return names.get_name(name, try_suffixes=('.weight', '.bias'))


def save_gguf(kind: str, path: Path, quantize: bool = False) -> tuple[Path, str, int]:
    """The tiny ``kind`` model saved in ``path / 'hf'`` and written as ``path / 'model.gguf'``; with ``quantize``
    every projection and the stacked experts as Q8_0 blocks, and the checkpoint rewritten with what they hold."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA4])
    vocab = _add_tokenizer(writer)
    overrides = {'vocab_size': vocab} | ({'vocab_size_per_layer_input': vocab} if kind == 'dense' else {})
    folder = save_random_model(CONFIGS[kind](**overrides), str(path / 'hf'), std=STD)
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config.num_hidden_layers)
    writer.add_tensor('rope_freqs.weight', rope_freqs(config))
    state = load_file(f'{folder}/model.safetensors')
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if quantize and name.endswith(('proj.weight', 'gate_up_proj', 'down_proj')) and data.shape[-1] % 32 == 0:
            data = gguf.quants.quantize(data, Q.Q8_0)
            state[name] = torch.from_numpy(gguf.quants.dequantize(data, Q.Q8_0))
        writer.add_tensor(converter_name(name, names), np.ascontiguousarray(data),
                          raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    if quantize:
        save_file(state, f'{folder}/model.safetensors', metadata={'format': 'pt'})
    finish(writer)
    return src, folder, vocab


@pytest.mark.parametrize('kind', sorted(CONFIGS))
def test_gguf_matches_transformers(kind: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    converted = converted_model(src, tmp_path, hf)
    for field in ('layer_types', 'sliding_window', 'num_kv_shared_layers', 'intermediate_size', 'use_double_wide_mlp',
                  'hidden_size_per_layer_input', 'attention_k_eq_v', 'enable_moe_block', 'num_experts',
                  'top_k_experts', 'moe_intermediate_size', 'final_logit_softcapping', 'rope_parameters'):
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    assert [(c.num_key_value_heads, c.head_dim) for c in converted.config.per_layer_config] == [
        (c.num_key_value_heads, c.head_dim) for c in hf.config.per_layer_config]

    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


@pytest.mark.slow
def test_q8_0_experts_dequantized(tmp_path: Path, monkeypatch) -> None:
    """A MoE file whose projections and stacked experts are Q8_0 serves, dequantized, the tokens transformers gives
    on the weights those blocks hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf('moe', tmp_path, quantize=True)
    reader = gguf.GGUFReader(str(src))
    assert {t.tensor_type for t in reader.tensors if t.name.endswith('_exps.weight')} == {Q.Q8_0}
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))
