"""PhiMoE from GGUF (llama.cpp's ``phimoe``): a tiny random transformers model written as convert_hf_to_gguf.py
writes it (Phi-3's rope keys, the LongRoPE factors as ``rope_factors_long``/``rope_factors_short`` and one
``rope.scaling.attn_factor`` computed from the context lengths, the biased LayerNorms and projections, the LM head
bias, the experts stacked per projection), read back into the original tensors and served token for token like
transformers on the original model; with the projections and experts in Q8_0, served as their blocks."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import MODEL_TENSOR as T
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf import _add_tokenizer, finish
from test_gguf_llama_like import converted_model
from test_phimoe import LONG_ROPE, ORIGINAL_MAX, phimoe_config

MAX_POSITIONS = 1024
# what the converter writes for the LongRoPE of MAX_POSITIONS over ORIGINAL_MAX: both cos/sin factors of the file
ATTN_FACTOR = math.sqrt(1 + math.log(MAX_POSITIONS / ORIGINAL_MAX) / math.log(ORIGINAL_MAX))
QUANTIZED = ('proj.weight', '.w1.weight', '.w2.weight', '.w3.weight')

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def file_tensors(folder: str, arch: gguf.MODEL_ARCH, layers: int, quantize: bool,
                 quantized: tuple[str, ...] = QUANTIZED) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under the file's names, the experts stacked per projection and the routers'
    correction biases (``e_score_correction_bias``, Trinity's ``expert_bias``) as ``exp_probs_b.bias``, as the converter writes them; with
    ``quantize`` the tensors named ``*quantized`` as Q8_0 blocks, and the checkpoint in ``folder`` rewritten with what
    those blocks hold."""
    state = load_file(str(Path(folder) / 'model.safetensors'))
    names = gguf.get_tensor_name_map(arch, layers)
    stacked: dict[str, list[np.ndarray]] = {}
    out = {}
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if quantize and name.endswith(quantized):
            data = gguf.quants.quantize(data, Q.Q8_0)
            state[name] = torch.from_numpy(gguf.quants.dequantize(data, Q.Q8_0))
        if '.experts.' in name:
            prefix, _, rest = name.partition('.experts.')
            stacked.setdefault(f'{prefix}.experts.{rest.partition(".")[2]}', []).append(data)
        else:
            name = name.replace('e_score_correction_bias', 'e_score_correction.bias')
            name = name.replace('.expert_bias', '.expert_bias.bias')  # Trinity's
            out[names.get_name(name, try_suffixes=('.weight', '.bias'))] = data
    for name, experts in stacked.items():  # in expert order: the checkpoint lists them sorted
        out[names.get_name(name, try_suffixes=('.weight',))] = np.stack(experts)
    if quantize:
        save_file(state, str(Path(folder) / 'model.safetensors'), metadata={'format': 'pt'})
    return out


def write_gguf(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    """``tensors`` (Q8_0 where they are blocks) written after the metadata."""
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    finish(writer)


def assert_q8_0_served_as_blocks(src: Path, folder: str, vocab: int, served: tuple[str, ...],
                                 dense: tuple[str, ...], sparse_served: tuple[str, ...] = ()) -> None:
    """The layers' ``served`` linear layers of the Q8_0 file ``src`` (and ``sparse_served`` of the MoE layers after
    the dense first) are served as their blocks, the ``dense`` ones are not; token for token like transformers on
    the weights the blocks hold (the model saved in ``folder``)."""
    hf = hf_causal_lm(folder)
    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    for layer in range(hf.config.num_hidden_layers):
        for name in served:
            assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
        for name in dense:
            assert f'layers.{layer}.{name}' not in layer_types
        for name in sparse_served if layer else ():
            assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


def text_model_keys(writer: gguf.GGUFWriter, config) -> list[tuple[Callable, Any]]:
    """The keys convert_hf_to_gguf.py's ``TextModel`` writes for a model with ``head_dim``, as (writer method, value)."""
    return [(writer.add_block_count, config.num_hidden_layers),
            (writer.add_context_length, config.max_position_embeddings),
            (writer.add_embedding_length, config.hidden_size),
            (writer.add_feed_forward_length, config.intermediate_size),
            (writer.add_head_count, config.num_attention_heads),
            (writer.add_head_count_kv, config.num_key_value_heads),
            (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
            (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
            (writer.add_layer_norm_rms_eps, config.rms_norm_eps)]


def assert_f32_file_matches_transformers(src: Path, folder: str, vocab: int, path: Path):
    """The F32 file ``src`` reads back into the checkpoint in ``folder`` bit for bit and is served token for token
    like transformers on it; the converted model."""
    hf = hf_causal_lm(folder)
    converted = converted_model(src, path, hf)
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))
    return converted


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """Phi3MiniModel's keys and PhiMoeModel's expert counts."""
    head_dim = config.hidden_size // config.num_attention_heads
    for add, value in [(writer.add_context_length, config.max_position_embeddings),
                       (writer.add_rope_scaling_orig_ctx_len, ORIGINAL_MAX),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_block_count, config.num_hidden_layers),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_rope_dimension_count, head_dim),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_sliding_window, 0), (writer.add_rope_scaling_attn_factors, ATTN_FACTOR),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_expert_count, config.num_local_experts)]:
        add(value)


def save_gguf(path: Path, quantize: bool) -> tuple[Path, str, int]:
    """A tiny random PhiMoE (its cos/sin factors the file's) in ``path / 'hf'`` written to ``path / 'model.gguf'``:
    the file, the folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.PHIMOE])
    vocab = _add_tokenizer(writer)
    rope = LONG_ROPE | {'short_mscale': ATTN_FACTOR, 'long_mscale': ATTN_FACTOR}
    folder = save_random_model(phimoe_config(vocab_size=vocab, max_position_embeddings=MAX_POSITIONS,
                                             rope_parameters=rope), str(path / 'hf'))
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    tensors = file_tensors(folder, gguf.MODEL_ARCH.PHIMOE, config.num_hidden_layers, quantize)
    tensors[gguf.TENSOR_NAMES[T.ROPE_FACTORS_LONG] + '.weight'] = np.asarray(rope['long_factor'], np.float32)
    tensors[gguf.TENSOR_NAMES[T.ROPE_FACTORS_SHORT] + '.weight'] = np.asarray(rope['short_factor'], np.float32)
    write_gguf(writer, tensors)
    return src, folder, vocab


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    """Read back bit for bit (biases, the LM head's included); served like transformers over prompts within and
    beyond the original context."""
    src, folder, vocab = save_gguf(tmp_path, quantize=False)
    hf = hf_causal_lm(folder)
    converted = converted_model(src, tmp_path, hf)
    assert converted.config.rope_parameters['long_mscale'] == pytest.approx(ATTN_FACTOR)
    prompts = random_prompts([5, 20, 80], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


def test_gguf_q8_0_kept_as_blocks(tmp_path: Path) -> None:
    """Attention's projections and the experts in Q8_0 are served as their blocks (the router stays dense), token for
    token like transformers on the weights they hold."""
    src, folder, vocab = save_gguf(tmp_path, quantize=True)
    assert_q8_0_served_as_blocks(src, folder, vocab, ('self_attn.qkv_proj', 'self_attn.o_proj',
                                                      'mlp.experts.gate_up_proj', 'mlp.experts.down_proj'),
                                 ('mlp.gate',))
