"""OLMo 2/3, Granite 3, Seed-OSS and ERNIE 4.5 (dense and MoE) from GGUF: a tiny random transformers model written
as llama.cpp's converter writes it (gguf-py's tensor names, the converter's metadata, Llama's q/k row order for
Granite, stacked experts for ERNIE 4.5 MoE), read back into the original tensors and served token for token like
transformers on the original model."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import assert_same_state, assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf import _add_tokenizer, finish, llama_permute
from test_model_families import save_family

from lmdeploy.pytorch.weights.gguf import convert_gguf

ARCHS = {'olmo2': gguf.MODEL_ARCH.OLMO2, 'olmo3': gguf.MODEL_ARCH.OLMO2, 'granite': gguf.MODEL_ARCH.GRANITE,
         'seed_oss': gguf.MODEL_ARCH.SEED_OSS, 'ernie4_5': gguf.MODEL_ARCH.ERNIE4_5,
         'ernie4_5_moe': gguf.MODEL_ARCH.ERNIE4_5_MOE}


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The keys convert_hf_to_gguf.py writes for ``config``'s family."""
    rope = config.rope_parameters.get('full_attention', config.rope_parameters)
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, rope['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps)]:
        add(value)
    if rope['rope_type'] == 'yarn':
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope['factor'])
        writer.add_rope_scaling_orig_ctx_len(rope['original_max_position_embeddings'])
    if config.model_type in ('seed_oss', 'ernie4_5', 'ernie4_5_moe'):  # TextModel: head_dim as key/value length
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.model_type == 'olmo3':
        writer.add_rope_freq_base_swa(config.rope_parameters['sliding_attention']['rope_theta'])
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([kind == 'sliding_attention' for kind in config.layer_types])
    if config.model_type == 'granite':  # LlamaModel without head_dim; the multipliers as scales
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if config.model_type == 'ernie4_5_moe':
        writer.add_expert_count(config.moe_num_experts)
        writer.add_expert_used_count(config.moe_k)
        writer.add_interleave_moe_layer_step(config.moe_layer_interval)
        writer.add_leading_dense_block_count(config.moe_layer_start_index)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.moe_num_shared_experts)
        writer.add_expert_shared_feed_forward_length(config.intermediate_size // config.num_key_value_heads)


def converter_arrays(folder: str, config, quantize: bool) -> dict[str, np.ndarray]:
    """The saved checkpoint's tensors as the converter hands them to gguf-py: Granite's q/k rows permuted, each MoE
    layer's experts stacked (``mlp.experts.{gate,up,down}_proj.weight [E, ...]``); with ``quantize`` every
    projection's as Q8_0 blocks, and the checkpoint in ``folder`` rewritten with what those blocks hold."""
    state = load_file(str(Path(folder) / 'model.safetensors'))
    arrays = {}
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if quantize and name.endswith('proj.weight'):  # row by row: the same blocks before or after a permutation
            data = gguf.quants.quantize(data, Q.Q8_0)
            state[name] = torch.from_numpy(gguf.quants.dequantize(data, Q.Q8_0))
        if config.model_type == 'granite' and name.endswith(('q_proj.weight', 'k_proj.weight')):
            data = llama_permute(data, config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads)
        arrays[name.replace('e_score_correction_bias', 'e_score_correction.bias')] = data  # the converter's rename
    if quantize:
        save_file(state, str(Path(folder) / 'model.safetensors'), metadata={'format': 'pt'})
    for layer in range(config.num_hidden_layers):
        prefix = f'model.layers.{layer}.mlp.experts'
        for proj in ('gate_proj', 'up_proj', 'down_proj'):
            experts = getattr(config, 'moe_num_experts', None) or getattr(config, 'num_experts', 0)
            names = [f'{prefix}.{expert}.{proj}.weight' for expert in range(experts)]
            if names and names[0] in arrays:
                arrays[f'{prefix}.{proj}.weight'] = np.stack([arrays.pop(name) for name in names])
    return arrays


def write_gguf(folder: str, writer: gguf.GGUFWriter, quantize: bool) -> None:
    """The model saved in ``folder`` written by ``writer`` (its tokenizer added) as the converter writes it."""
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    names = gguf.get_tensor_name_map(ARCHS[config.model_type], config.num_hidden_layers)
    for name, data in converter_arrays(folder, config, quantize).items():
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data),
                          raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    finish(writer)


def converted_model(src: Path, path: Path, hf):
    """``src`` converted back to a transformers folder (``path / 'converted'``) and loaded: the same architecture and
    tensors as ``hf``, bit for bit; returned for its config."""
    convert_gguf(str(src), str(path / 'converted'))
    converted = AutoModelForCausalLM.from_pretrained(str(path / 'converted'), dtype=torch.float32)
    assert converted.config.architectures == hf.config.architectures
    assert_same_state(converted, hf)
    return converted


def save_gguf(kind: str, path: Path, quantize: bool) -> tuple[Path, str, int]:
    """A tiny random ``kind`` saved in ``path / 'hf'`` and written to ``path / 'model.gguf'``: the file, the
    folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[ARCHS[kind]])
    vocab = _add_tokenizer(writer)
    folder = save_family(kind, str(path / 'hf'), vocab_size=vocab)
    write_gguf(folder, writer, quantize)
    return src, folder, vocab


@pytest.mark.parametrize('kind', sorted(ARCHS))
def test_gguf_family_matches_transformers(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path, quantize=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    converted = converted_model(src, tmp_path, hf)
    if kind == 'olmo3':
        assert converted.config.layer_types == hf.config.layer_types
        ropes, hf_ropes = converted.config.rope_parameters, hf.config.rope_parameters
        assert ropes['sliding_attention'] == hf_ropes['sliding_attention']
        assert ropes['full_attention'].items() >= hf_ropes['full_attention'].items()  # with YaRN's default betas

    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


@pytest.mark.parametrize('kind', ['olmo3', 'granite', 'ernie4_5_moe'])
def test_gguf_family_q8_0_kept_as_blocks(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection (experts and shared experts too) in Q8_0 is served as its blocks, token for token like
    transformers on the weights those blocks hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path, quantize=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    for layer in range(hf.config.num_hidden_layers):
        for name in ('self_attn.qkv_proj', 'self_attn.o_proj'):
            assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
    if kind == 'ernie4_5_moe':
        assert layer_types['layers.0.mlp.gate_up_proj'] == layer_types['layers.1.mlp.experts.gate_up_proj'] == 'Q8_0'
        assert layer_types['layers.1.mlp.shared_experts.down_proj'] == 'Q8_0'
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
