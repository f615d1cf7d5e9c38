"""Gemma 3n from GGUF (llama.cpp's ``gemma3n``): the tiny random model of ``test_gemma3n.py`` written as
convert_hf_to_gguf.py's Gemma3NModel writes it (gguf-py's tensor names, AltUp's projections stacked, the MLP's
sparsity as Gaussian quantiles, the sliding layers as flags, the KV-sharing layers, AltUp's and the per-layer inputs'
keys), read back into the original tensors and served token for token like transformers on the original model."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import save_random_model
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gemma3n import gemma3n_config
from test_gguf import _add_tokenizer, finish
from test_gguf_llama_like import converted_model

STACKED = ('model.altup_projections', 'model.altup_unembed_projections')


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The keys Gemma3NModel writes (Gemma3Model's, then its own; no local rope base: llama.cpp's 10000)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters['full_attention']['rope_theta'])
    writer.add_sliding_window(config.sliding_window)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_vocab_size(config.vocab_size)
    writer.add_altup_active_idx(config.altup_active_idx)
    writer.add_altup_num_inputs(config.altup_num_inputs)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    normal = torch.distributions.Normal(0, 1)
    writer.add_activation_sparsity_scale([normal.icdf(torch.tensor(s, dtype=torch.float32)).item()
                                          for s in config.activation_sparsity_pattern])
    writer.add_sliding_window_pattern([kind == 'sliding_attention' for kind in config.layer_types])


def converter_arrays(folder: str, config) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as the converter hands them to gguf-py: AltUp's projections stacked, each
    ``*_scale`` named as a weight."""
    arrays = {name + ('.weight' if name.endswith('_scale') else ''): tensor.float().numpy()
              for name, tensor in load_file(f'{folder}/model.safetensors').items()}
    for prefix in STACKED:
        names = [f'{prefix}.{i}.weight' for i in range(config.altup_num_inputs - 1)]
        arrays[f'{prefix}.weight'] = np.stack([arrays.pop(name) for name in names])
    return arrays


def save_gguf(path: Path) -> tuple[Path, str, int]:
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA3N])
    vocab = _add_tokenizer(writer)
    folder = save_random_model(gemma3n_config(vocab_size=vocab, vocab_size_per_layer_input=vocab), str(path / 'hf'))
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3N, config.num_hidden_layers)
    for name, data in converter_arrays(folder, config).items():
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data))
    finish(writer)
    return src, folder, vocab


def test_gguf_matches_transformers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    converted = converted_model(src, tmp_path, hf)
    for field in ('layer_types', 'sliding_window', 'num_kv_shared_layers', 'activation_sparsity_pattern',
                  'intermediate_size', 'laurel_rank', 'hidden_size_per_layer_input', 'altup_num_inputs',
                  'vocab_size_per_layer_input', 'final_logit_softcapping'):
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    assert converted.config.rope_parameters == hf.config.rope_parameters

    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))
