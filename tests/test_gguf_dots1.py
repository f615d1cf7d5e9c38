"""dots.llm1 from GGUF (llama.cpp's ``dots1``): a tiny random transformers model written as convert_hf_to_gguf.py
writes it (Qwen2-MoE's keys plus the dense first layers, the shared experts' count, the routing scale and
renormalization, the sigmoid gating; the correction bias as ``exp_probs_b.bias``, the experts stacked per
projection), read back into the original tensors and served token for token like transformers on the original
model; with the projections, experts and shared experts in Q8_0, served as their blocks."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import AutoConfig

from conftest import save_random_model
from test_dots1 import dots1_config
from test_gguf import _add_tokenizer
from test_gguf_phimoe import (assert_f32_file_matches_transformers, assert_q8_0_served_as_blocks, file_tensors,
                              text_model_keys, write_gguf)

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """Qwen2MoeModel's keys and Dots1Model's."""
    keys = [(writer.add_expert_count, config.n_routed_experts),
            (writer.add_expert_used_count, config.num_experts_per_tok),
            (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
            (writer.add_leading_dense_block_count, config.first_k_dense_replace),
            (writer.add_expert_shared_count, config.n_shared_experts),
            (writer.add_expert_weights_scale, config.routed_scaling_factor),
            (writer.add_expert_weights_norm, config.norm_topk_prob),
            (writer.add_expert_gating_func, gguf.ExpertGatingFuncType.SIGMOID)]
    for add, value in text_model_keys(writer, config) + keys:
        add(value)


def save_gguf(path: Path, quantize: bool) -> tuple[Path, str, int]:
    """A tiny random dots.llm1 (full attention in every layer, as the files run) in ``path / 'hf'`` written to
    ``path / 'model.gguf'``: the file, the folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DOTS1])
    vocab = _add_tokenizer(writer)
    config = dots1_config(vocab_size=vocab, sliding_window=None, layer_types=['full_attention'] * 3)
    folder = save_random_model(config, str(path / 'hf'), std={'e_score_correction_bias': 0.3})
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    write_gguf(writer, file_tensors(folder, gguf.MODEL_ARCH.DOTS1, config.num_hidden_layers, quantize))
    return src, folder, vocab


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    src, folder, vocab = save_gguf(tmp_path, quantize=False)
    assert_f32_file_matches_transformers(src, folder, vocab, tmp_path)


def test_gguf_q8_0_kept_as_blocks(tmp_path: Path) -> None:
    """Attention's projections, the dense layer's MLP, the experts and shared experts in Q8_0 are served as their
    blocks (the fp32 routers stay dense), token for token like transformers on the weights they hold."""
    src, folder, vocab = save_gguf(tmp_path, quantize=True)
    assert_q8_0_served_as_blocks(src, folder, vocab, ('self_attn.qkv_proj', 'self_attn.o_proj'), ('mlp.gate',),
                                 ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj',
                                  'mlp.shared_experts.gate_up_proj', 'mlp.shared_experts.down_proj'))
