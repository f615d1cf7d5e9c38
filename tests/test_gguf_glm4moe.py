"""GLM-4.5 from GGUF (llama.cpp's ``glm4moe``): a tiny random transformers model written as convert_hf_to_gguf.py
writes it (experts stacked per projection, the router's correction bias as ``exp_probs_b``, the
next-token-prediction layer appended past the decoder's with its ``nextn.*`` tensors), served by the engine
token for token like transformers; in F32, and with every projection and expert in Q8_0 kept as its blocks."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_same_state, assert_transformers_greedy, make_engine, q8_0_blocks, random_prompts, run
from test_glm4_moe import glm4_moe_config
from test_gguf import _add_tokenizer, finish

from lmdeploy.pytorch.weights.gguf import convert_gguf

HIDDEN = 64  # Q8_0 blocks of 32 inputs
NEXTN_TENSORS = ('eh_proj.weight', 'enorm.weight', 'hnorm.weight', 'shared_head.norm.weight')


def write_metadata(config, writer: gguf.GGUFWriter) -> None:
    """What Glm4MoeModel writes, with its next-token-prediction layer counted in ``block_count``."""
    writer.add_block_count(config.num_hidden_layers + config.num_nextn_predict_layers)
    writer.add_nextn_predict_layers(config.num_nextn_predict_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters['rope_theta'])
    writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters['partial_rotary_factor']))
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)


def converter_tensors(hf: torch.nn.Module, quantize: bool) -> dict[str, np.ndarray]:
    """``hf``'s tensors as the converter names them before mapping (experts per projection, stacked), plus a
    next-token-prediction layer (a copy of the last layer and its own tensors); with ``quantize`` the
    projections and experts in Q8_0, and ``hf``'s set to what those blocks hold."""
    out = {}
    with torch.no_grad():
        for name, param in hf.state_dict().items():
            data = param.numpy()
            if name.endswith('e_score_correction_bias'):
                out[name.replace('_bias', '.bias')] = data
                continue
            if name.endswith(('proj.weight', 'experts.gate_up_proj', 'experts.down_proj')) and quantize:
                data = q8_0_blocks(param)
            if name.endswith('experts.gate_up_proj'):
                gate, up = np.split(data, 2, axis=1)
                out[name.replace('gate_up_proj', 'gate_proj.weight')] = gate
                out[name.replace('gate_up_proj', 'up_proj.weight')] = up
            elif name.endswith('experts.down_proj'):
                out[f'{name}.weight'] = data
            else:
                out[name] = data
    last, mtp = hf.config.num_hidden_layers - 1, hf.config.num_hidden_layers
    rng = np.random.default_rng(0)
    for name, data in list(out.items()):
        if name.startswith(f'model.layers.{last}.'):
            out[name.replace(f'layers.{last}.', f'layers.{mtp}.')] = data.copy()
    hidden = hf.config.hidden_size
    for name in NEXTN_TENSORS:
        shape = (hidden, 2 * hidden) if name == 'eh_proj.weight' else (hidden,)
        out[f'model.layers.{mtp}.{name}'] = rng.standard_normal(shape, dtype=np.float32)
    return out


def write_gguf(hf: torch.nn.Module, writer: gguf.GGUFWriter, quantize: bool) -> None:
    write_metadata(hf.config, writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, hf.config.num_hidden_layers + 1)
    for name, data in converter_tensors(hf, quantize).items():
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data),
                          raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    finish(writer)


def random_glm4_moe(path: Path, quantize: bool) -> torch.nn.Module:
    """A tiny random GLM-4.5 (q/k norms, attention biases, two groups of experts) written to ``path / 'model.gguf'``
    as the converter writes it; transformers' model of the weights the file holds."""
    writer = gguf.GGUFWriter(str(path / 'model.gguf'), 'glm4moe')
    vocab = _add_tokenizer(writer)
    config = glm4_moe_config(use_qk_norm=True, attention_bias=True, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5)
    config.hidden_size, config.vocab_size = HIDDEN, vocab
    hf = hf_causal_lm(save_random_model(config, str(path / 'hf'), std={'e_score_correction_bias': 0.1}))
    write_gguf(hf, writer, quantize)
    return hf


def write_k_quant_glm4_moe(folder: Path, path: Path, types: dict[str, Q]) -> None:
    """A tiny random GLM-4.5 at K-quant sizes (hidden size, heads, dense and expert widths in whole blocks of 256
    inputs; GLM-4.5's grouped routing and attention biases) written to ``path`` as the converter writes it, each
    matrix (a stack of experts) random blocks of the type ``types`` gives its GGUF name (``blk.1.ffn_down_exps``;
    else ``default``, see :func:`test_gguf_mixed.encode`); routers and 1-D tensors F32."""
    from test_gguf_mixed import encode
    writer = gguf.GGUFWriter(str(path), 'glm4moe')
    vocab = _add_tokenizer(writer)
    config = glm4_moe_config(use_qk_norm=False, attention_bias=True, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5)
    config.hidden_size, config.head_dim, config.intermediate_size, config.moe_intermediate_size = 256, 64, 512, 256
    config.vocab_size = vocab
    hf = hf_causal_lm(save_random_model(config, str(folder), std={'e_score_correction_bias': 0.1}))
    write_metadata(hf.config, writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, hf.config.num_hidden_layers + 1)
    rng = np.random.default_rng(0)
    for name, data in converter_tensors(hf, quantize=False).items():
        gguf_name = names.get_name(name, try_suffixes=('.weight', '.bias'))
        matrix = data.ndim > 1 and data.shape[0] > 1 and not gguf_name.endswith('ffn_gate_inp.weight')
        qtype = types.get(gguf_name.rpartition('.')[0], types['default']) if matrix else Q.F32
        stored = encode(np.ascontiguousarray(data), qtype, rng)
        writer.add_tensor(gguf_name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    finish(writer)


def test_gguf_glm4moe_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'model.gguf'
    hf = random_glm4_moe(tmp_path, quantize=False)

    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())  # all dequantized: transformers loads it
    index = json.loads((tmp_path / 'converted' / 'model.safetensors.index.json').read_text())
    assert not [name for name in index['weight_map'] if name.startswith('model.layers.3.')]  # the MTP layer
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    for field in ('architectures', 'num_hidden_layers', 'rope_parameters', 'use_qk_norm', 'attention_bias',
                  'n_group', 'topk_group', 'norm_topk_prob', 'routed_scaling_factor', 'first_k_dense_replace',
                  'n_routed_experts', 'n_shared_experts', 'moe_intermediate_size', 'head_dim'):
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    assert_same_state(converted, hf)

    prompts = random_prompts([5, 23, 41], vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


def test_gguf_glm4moe_q8_0_experts_kept_as_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention, the dense MLP, the shared experts and the routed experts in Q8_0 are all served as their
    blocks (the routers stay F32), token for token like transformers on the weights those blocks hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'model.gguf'
    hf = random_glm4_moe(tmp_path, quantize=True)

    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    for layer in range(hf.config.num_hidden_layers):
        mlp = 'mlp' if layer < hf.config.first_k_dense_replace else 'mlp.shared_experts'
        for name in ('self_attn.qkv_proj', 'self_attn.o_proj', f'{mlp}.gate_up_proj', f'{mlp}.down_proj'):
            assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
        if layer >= hf.config.first_k_dense_replace:
            assert layer_types[f'layers.{layer}.mlp.experts.gate_up_proj'] == 'Q8_0'
    prompts = random_prompts([5, 41], vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
