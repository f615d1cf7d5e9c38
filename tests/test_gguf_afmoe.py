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
from test_afmoe import afmoe_config
from test_gguf import _add_tokenizer
from test_gguf_phimoe import (assert_f32_file_matches_transformers, assert_q8_0_served_as_blocks, file_tensors,
                              text_model_keys, write_gguf)

EXPERTS = ('.gate_proj.weight', '.up_proj.weight', '.down_proj.weight')

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """LlamaModel's keys (TextModel's, the vocabulary size and rotary dimensions) and AfmoeModel's."""
    keys = [(writer.add_expert_count, config.num_experts),
            (writer.add_expert_used_count, config.num_experts_per_tok),
            (writer.add_vocab_size, config.vocab_size),
            (writer.add_rope_dimension_count, config.head_dim),
            (writer.add_expert_shared_count, config.num_shared_experts),
            (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
            (writer.add_leading_dense_block_count, config.num_dense_layers),
            (writer.add_expert_weights_scale, config.route_scale),
            (writer.add_sliding_window, config.sliding_window)]
    for add, value in text_model_keys(writer, config) + keys:
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


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    src, folder, vocab = save_gguf(tmp_path, quantize=False)
    converted = assert_f32_file_matches_transformers(src, folder, vocab, tmp_path)
    assert converted.config.layer_types == AutoConfig.from_pretrained(folder).layer_types


def test_gguf_q8_0_experts_kept_as_blocks(tmp_path: Path) -> None:
    """With every gate, up and down projection in Q8_0 (the attention's gate, the dense and shared MLPs', the
    experts'), the experts are served as their blocks and the others dequantized (the file's linear layers are not
    all projections of the engine's kinds), token for token like transformers on the weights they hold."""
    src, folder, vocab = save_gguf(tmp_path, quantize=True)
    assert_q8_0_served_as_blocks(src, folder, vocab, (), (), ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj'))
