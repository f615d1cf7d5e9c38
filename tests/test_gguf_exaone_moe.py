"""K-EXAONE from GGUF (llama.cpp's ``exaone-moe``): a tiny random transformers model written as convert_hf_to_gguf.py
writes it (EXAONE 4's keys with a per-layer sliding-window pattern, the experts' keys, the dense first layers, the
correction bias as ``exp_probs_b.bias``, the experts stacked per projection, no group count), read back into the
original tensors and served token for token like transformers on the original model, at prompts longer than the
window; with the projections, experts and shared experts in Q8_0, served as their blocks."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import AutoConfig

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_exaone_moe import exaone_moe_config
from test_gguf import _add_tokenizer
from test_gguf_llama_like import converted_model
from test_gguf_phimoe import assert_q8_0_served_as_blocks, file_tensors, write_gguf


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """Exaone4Model's keys (TextModel's, the window and its per-layer pattern) and ExaoneMoEModel's."""
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
                       (writer.add_sliding_window, config.sliding_window),
                       (writer.add_sliding_window_pattern, [t == 'sliding_attention' for t in config.layer_types]),
                       (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
                       (writer.add_expert_shared_count, config.num_shared_experts),
                       (writer.add_expert_shared_feed_forward_length,
                        config.moe_intermediate_size * config.num_shared_experts),
                       (writer.add_expert_weights_scale, config.routed_scaling_factor),
                       (writer.add_expert_weights_norm, config.norm_topk_prob),
                       (writer.add_leading_dense_block_count, config.first_k_dense_replace),
                       (writer.add_nextn_predict_layers, 0),
                       (writer.add_rope_scaling_type, gguf.RopeScalingType.NONE)]:
        add(value)


def save_gguf(path: Path, quantize: bool) -> tuple[Path, str, int]:
    """A tiny random K-EXAONE (its experts in one group, as the files route them) in ``path / 'hf'`` written to
    ``path / 'model.gguf'``: the file, the folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.EXAONE_MOE])
    vocab = _add_tokenizer(writer)
    folder = save_random_model(exaone_moe_config(vocab_size=vocab, n_group=1), str(path / 'hf'),
                               std={'e_score_correction_bias': 0.3})
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    write_gguf(writer, file_tensors(folder, gguf.MODEL_ARCH.EXAONE_MOE, config.num_hidden_layers, quantize))
    return src, folder, vocab


def test_gguf_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(tmp_path, quantize=False)
    hf = hf_causal_lm(folder)
    converted = converted_model(src, tmp_path, hf)
    assert converted.config.layer_types == hf.config.layer_types
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


def test_gguf_q8_0_kept_as_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's projections, the experts and shared experts in Q8_0 are served as their blocks (the fp32 routers
    stay dense), token for token like transformers on the weights they hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(tmp_path, quantize=True)
    assert_q8_0_served_as_blocks(src, folder, vocab, ('self_attn.qkv_proj', 'self_attn.o_proj'), ('mlp.gate',))
    engine_types = make_engine(str(src)).model_config.hf_config.quantization_config['ggml_types']
    for layer in (1, 2):
        for name in ('experts.gate_up_proj', 'experts.down_proj', 'shared_experts.gate_up_proj',
                     'shared_experts.down_proj'):
            assert engine_types[f'layers.{layer}.mlp.{name}'] == 'Q8_0', (layer, name)
