"""MiMo-V2-Flash from GGUF (llama.cpp's ``mimo2``): a tiny random transformers model written as convert_hf_to_gguf.py
writes it (TextModel's keys, the KV heads per layer, the hub's window without the query, the sliding layers' flags,
the value length, the rotary features and the sliding layers' rope base, the sinks as ``attn_sinks``, the correction
bias as ``exp_probs_b.bias``, the experts stacked per projection, q/k rows unpermuted), read back into the original
tensors and served token for token like transformers on the original model, at prompts longer than the window;
with every projection and expert in Q8_0, the experts served as their blocks; a file whose sliding layers have other
than twice the full layers' KV heads is refused."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import AutoConfig

from conftest import save_random_model
from test_gguf import _add_tokenizer
from test_gguf_phimoe import (assert_f32_file_matches_transformers, assert_q8_0_served_as_blocks, file_tensors,
                              write_gguf)
from test_mimo_v2_flash import mimo_config

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.weights.gguf import convert_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def add_metadata(writer: gguf.GGUFWriter, config, kv_heads: list[int]) -> None:
    """TextModel's keys and MimoV2Model's: ``kv_heads`` per layer, the window as the hub's ``sliding_window`` (one
    less than transformers'), the layer pattern (1: sliding), the rotary features of the config's fraction."""
    rope = config.rope_parameters
    sliding = [int(kind == 'sliding_attention') for kind in config.layer_types]
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.v_head_dim),
                       (writer.add_rope_freq_base, rope['full_attention']['rope_theta']),
                       (writer.add_rope_freq_base_swa, rope['sliding_attention']['rope_theta']),
                       (writer.add_rope_dimension_count,
                        int(config.head_dim * rope['full_attention']['partial_rotary_factor'])),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_expert_count, config.n_routed_experts),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
                       (writer.add_sliding_window, config.sliding_window - 1),
                       (writer.add_sliding_window_pattern, sliding)]:
        add(value)


def save_gguf(path: Path, kv_factor: int = 2, quantize: bool = False) -> tuple[Path, str, int]:
    """The tiny MiMo-V2-Flash of ``test_mimo_v2_flash.py`` (one group of experts, as the converter assumes) in
    ``path / 'hf'`` written to ``path / 'model.gguf'`` (``quantize``: its projections and experts in Q8_0), its
    sliding layers' KV heads written as ``kv_factor`` times the full layers': the file, the folder and the
    vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MIMO2])
    vocab = _add_tokenizer(writer)
    folder = save_random_model(mimo_config(vocab_size=vocab, n_group=1), str(path / 'hf'),
                               std={'e_score_correction_bias': 0.3})
    config = AutoConfig.from_pretrained(folder)
    kv_heads = [config.num_key_value_heads * (kv_factor if kind == 'sliding_attention' else 1)
                for kind in config.layer_types]
    add_metadata(writer, config, kv_heads)
    tensors = file_tensors(folder, gguf.MODEL_ARCH.MIMO2, config.num_hidden_layers, quantize)
    # the converter names the sinks (``attention_sink_bias``, no kind) ``.weight``
    write_gguf(writer, {name + '.weight' if name.endswith('attn_sinks') else name: data
                        for name, data in tensors.items()})
    return src, folder, vocab


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    src, folder, vocab = save_gguf(tmp_path)
    converted = assert_f32_file_matches_transformers(src, folder, vocab, tmp_path)
    original = AutoConfig.from_pretrained(folder)
    for field in ('layer_types', 'mlp_layer_types', 'sliding_window', 'num_key_value_heads', 'v_head_dim'):
        assert getattr(converted.config, field) == getattr(original, field)


def test_gguf_q8_0_experts_kept_as_blocks(tmp_path: Path) -> None:
    """The experts are served as their Q8_0 blocks, the other linear layers dequantized (attention's projections
    are not of one width), token for token like transformers on the weights they hold."""
    src, folder, vocab = save_gguf(tmp_path, quantize=True)
    assert_q8_0_served_as_blocks(src, folder, vocab, (), ('self_attn.qkv_proj', 'self_attn.o_proj'),
                                 ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj'))


def test_gguf_other_kv_ratio_is_refused(tmp_path: Path) -> None:
    src, _, _ = save_gguf(tmp_path, kv_factor=1)
    with pytest.raises(ConfigError, match='twice the full layers'):
        convert_gguf(str(src), str(tmp_path / 'converted'))
