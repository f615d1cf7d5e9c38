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
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers import hf_greedy, make_engine, random_prompts, run
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


def checkpoint_tensors(folder: str, config) -> dict[str, torch.Tensor]:
    """The saved checkpoint's tensors as the converter hands them to gguf-py: each MoE layer's experts stacked
    (``mlp.experts.{gate,up,down}_proj.weight [E, ...]``)."""
    state = load_file(str(Path(folder) / 'model.safetensors'))
    for layer in range(config.num_hidden_layers):
        prefix = f'model.layers.{layer}.mlp.experts'
        for proj in ('gate_proj', 'up_proj', 'down_proj'):
            names = [f'{prefix}.{expert}.{proj}.weight' for expert in range(getattr(config, 'moe_num_experts', 0))]
            if names and names[0] in state:
                state[f'{prefix}.{proj}.weight'] = torch.stack([state.pop(name) for name in names])
    return state


def write_gguf(folder: str, config, path: Path, writer: gguf.GGUFWriter) -> None:
    add_metadata(writer, config)
    names = gguf.get_tensor_name_map(ARCHS[config.model_type], config.num_hidden_layers)
    for name, tensor in checkpoint_tensors(folder, config).items():
        data = tensor.float().numpy()
        if config.model_type == 'granite' and name.endswith(('q_proj.weight', 'k_proj.weight')):
            data = llama_permute(data, config.num_attention_heads if 'q_proj' in name
                                 else config.num_key_value_heads)
        name = name.replace('e_score_correction_bias', 'e_score_correction.bias')  # as the converter renames it
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data))
    finish(writer)


@pytest.mark.parametrize('kind', sorted(ARCHS))
def test_gguf_family_matches_transformers(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / f'{kind}.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[ARCHS[kind]])
    vocab = _add_tokenizer(writer)
    folder = save_family(kind, str(tmp_path / 'hf'), vocab_size=vocab)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    write_gguf(folder, hf.config, src, writer)

    convert_gguf(str(src), str(tmp_path / 'converted'))
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    assert converted.config.architectures == hf.config.architectures
    if kind == 'olmo3':
        assert converted.config.layer_types == hf.config.layer_types
        ropes, hf_ropes = converted.config.rope_parameters, hf.config.rope_parameters
        assert ropes['sliding_attention'] == hf_ropes['sliding_attention']
        assert ropes['full_attention'].items() >= hf_ropes['full_attention'].items()  # with YaRN's default betas
    state = hf.state_dict()
    assert converted.state_dict().keys() == state.keys()
    for name, value in converted.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)

    prompts = random_prompts([5, 40], vocab=vocab)
    assert run(make_engine(str(src)), prompts) == [hf_greedy(hf, p) for p in prompts]
