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
from test_exaone_moe import exaone_moe_config
from test_gguf import _add_tokenizer
from test_gguf_phimoe import (assert_f32_file_matches_transformers, assert_q8_0_served_as_blocks, file_tensors,
                              text_model_keys, write_gguf)

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """Exaone4Model's keys (TextModel's, the window and its per-layer pattern) and ExaoneMoEModel's."""
    keys = [(writer.add_expert_count, config.num_experts),
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
            (writer.add_rope_scaling_type, gguf.RopeScalingType.NONE)]
    for add, value in text_model_keys(writer, config) + keys:
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


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    src, folder, vocab = save_gguf(tmp_path, quantize=False)
    converted = assert_f32_file_matches_transformers(src, folder, vocab, tmp_path)
    assert converted.config.layer_types == AutoConfig.from_pretrained(folder).layer_types


def test_gguf_q8_0_kept_as_blocks(tmp_path: Path) -> None:
    """Attention's projections, the experts and shared experts in Q8_0 are served as their blocks (the fp32 routers
    stay dense), token for token like transformers on the weights they hold."""
    src, folder, vocab = save_gguf(tmp_path, quantize=True)
    assert_q8_0_served_as_blocks(src, folder, vocab, ('self_attn.qkv_proj', 'self_attn.o_proj'), ('mlp.gate',),
                                 ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj',
                                  'mlp.shared_experts.gate_up_proj', 'mlp.shared_experts.down_proj'))
