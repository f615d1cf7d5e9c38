"""Arcee Trinity from GGUF (llama.cpp's ``afmoe``): a tiny random transformers model written as convert_hf_to_gguf.py
writes it (Llama's keys with q/k rows unpermuted, the window, the experts' keys, the dense first layer, the attention
gate as ``attn_gate``, the four norms, the expert bias as ``exp_probs_b.bias``, the experts stacked per projection),
read back into the original tensors and served token for token like transformers on the original model (llama.cpp's
layout: a global layer every 4th, muP on), at prompts longer than the window; with the experts in Q8_0, served as
their blocks."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import AutoConfig

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_afmoe import afmoe_config
from test_gguf import _add_tokenizer
from test_gguf_llama_like import converted_model
from test_gguf_phimoe import file_tensors, write_gguf

EXPERTS = ('.gate_proj.weight', '.up_proj.weight', '.down_proj.weight')


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """LlamaModel's keys (TextModel's, the vocabulary size and rotary dimensions) and AfmoeModel's."""
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_expert_count, config.num_experts),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_vocab_size, config.vocab_size),
                       (writer.add_rope_dimension_count, config.head_dim),
                       (writer.add_expert_shared_count, config.num_shared_experts),
                       (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
                       (writer.add_leading_dense_block_count, config.num_dense_layers),
                       (writer.add_expert_weights_scale, config.route_scale),
                       (writer.add_sliding_window, config.sliding_window)]:
        add(value)


def save_gguf(path: Path, quantize: bool) -> tuple[Path, str, int]:
    """A tiny random Trinity of four layers in llama.cpp's layout (three local, one global) in ``path / 'hf'``
    written to ``path / 'model.gguf'``: the file, the folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.AFMOE])
    vocab = _add_tokenizer(writer)
    config = afmoe_config(vocab_size=vocab, num_hidden_layers=4, global_attn_every_n_layers=4)
    folder = save_random_model(config, str(path / 'hf'), std={'expert_bias': 0.3})
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    write_gguf(writer, file_tensors(folder, gguf.MODEL_ARCH.AFMOE, config.num_hidden_layers, quantize, EXPERTS))
    return src, folder, vocab


def test_gguf_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(tmp_path, quantize=False)
    hf = hf_causal_lm(folder)
    converted = converted_model(src, tmp_path, hf)
    assert converted.config.layer_types == hf.config.layer_types
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


def test_gguf_q8_0_experts_kept_as_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every gate, up and down projection in Q8_0 (the attention's gate, the dense and shared MLPs', the
    experts'), the experts are served as their blocks and the others dequantized (the file's linear layers are not
    all projections of the engine's kinds), token for token like transformers on the weights they hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(tmp_path, quantize=True)
    hf = hf_causal_lm(folder)
    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    for layer in range(1, 4):
        for name in ('experts.gate_up_proj', 'experts.down_proj'):
            assert layer_types[f'layers.{layer}.mlp.{name}'] == 'Q8_0', (layer, name)
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
