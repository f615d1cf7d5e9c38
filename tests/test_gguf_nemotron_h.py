"""Nemotron-H from GGUF (llama.cpp's ``nemotron_h`` and ``nemotron_h_moe``): tiny random ``NemotronHForCausalLM``
models (Mamba-2, attention, squared-ReLU MLP blocks; MoE blocks with the latent projections) written
as convert_hf_to_gguf.py's ``NemotronHModel`` writes them (``Mamba2Model``'s tensors, q/k rows permuted, the experts
stacked, per-layer ``head_count_kv`` and ``feed_forward_length``, no rotary, a next-token-prediction block), read
back into the checkpoint bit for bit and served token for token like transformers; a Q8_0 file's projections (the
experts' too) served as their blocks."""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import save_random_model
from family_checks import assert_batched_equals_solo_and_frees, assert_matches_transformers, hf_causal_lm
from helpers import assert_same_state, assert_transformers_greedy, make_engine, random_prompts
from test_gguf import _add_tokenizer, finish, llama_permute
from test_gguf_granitehybrid import add_mamba2_metadata, mamba2_tensor, write_gguf
from test_gguf_qwen3_next import layer_types
from test_nemotron_h import nemotron_3_config, nemotron_h_config

from lmdeploy.pytorch.weights.gguf import convert_gguf


pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def nemotron_3(latent: int | None, pattern: str = 'M*EME'):
    """``pattern``'s blocks with Nemotron 3's MoE blocks (``test_nemotron_h.nemotron_3_config``) in one expert group (as
    Nemotron 3 Nano's: llama.cpp routes without groups), shared experts of 64 (whole Q8_0 blocks)."""
    config, moe = nemotron_h_config(pattern), nemotron_3_config(latent)
    for field in ('n_routed_experts', 'num_experts_per_tok', 'moe_intermediate_size', 'moe_latent_size',
                  'routed_scaling_factor'):
        setattr(config, field, getattr(moe, field))
    config.n_group = config.topk_group = 1
    config.moe_shared_expert_intermediate_size = 64
    return config


# Mamba-2, MLP, attention, MLP, Mamba-2, MLP; MoE blocks with latent projections around attention; every kind
VARIANTS = {'mlp': lambda: nemotron_h_config(), 'moe_latent': lambda: nemotron_3(32),
            'every_kind': lambda: nemotron_3(32, 'M-*EM')}


def stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each MoE block's experts stacked as ``NemotronHModel.modify_tensors`` stacks them
    (``model.layers.{i}.mlp.experts.{up,down}_proj.weight [E, ...]``)."""
    out, experts = {}, {}
    for name, data in state.items():
        match = re.fullmatch(r'backbone\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(\w+)\.weight', name)
        if match:
            experts.setdefault(f'model.layers.{match[1]}.mlp.experts.{match[3]}.weight', {})[int(match[2])] = data
        else:
            out[name] = data
    return out | {name: torch.stack([parts[e] for e in sorted(parts)]) for name, parts in experts.items()}


def converter_arrays(config, state: dict[str, torch.Tensor], arch: gguf.MODEL_ARCH) -> dict[str, torch.Tensor]:
    """``NemotronHModel.modify_tensors``: the Mamba-2 blocks' tensors as ``Mamba2Model``'s, q/k rows permuted as
    Llama's, the experts stacked, the router's correction bias as ``e_score_correction.bias``; by gguf-py's names."""
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out = {}
    for name, data in stacked_experts(state).items():
        name, data = mamba2_tensor(name.replace('e_score_correction_bias', 'e_score_correction.bias'), data,
                                   config.n_groups)
        if name.endswith(('q_proj.weight', 'k_proj.weight')):
            heads = config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads
            data = torch.from_numpy(llama_permute(data.numpy(), heads))
        out[names.get_name(name, try_suffixes=('.weight', '.bias'))] = data
    return out


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """TextModel's keys (the norms' epsilon as the RMS one llama.cpp requires),
    ``GraniteHybridModel``'s Mamba-2 keys and per-layer ``head_count_kv``, ``NemotronHModel``'s head width,
    per-layer ``feed_forward_length`` and expert keys; with experts, one next-token-prediction block past the
    decoder's (attention and MoE in the per-layer arrays, as the converter counts it)."""
    moe = 'moe' in config.layers_block_type
    kinds = config.layers_block_type + (['full_attention+moe'] if moe else [])
    for add, value in [(writer.add_block_count, len(kinds)),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_layer_norm_rms_eps, config.layer_norm_epsilon),
                       (writer.add_vocab_size, config.vocab_size),
                       (writer.add_rope_scaling_finetuned, False),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_feed_forward_length,
                        [(config.moe_intermediate_size if moe else config.intermediate_size)
                         if kind.endswith(('mlp', 'moe')) else 0 for kind in kinds])]:
        add(value)
    add_mamba2_metadata(writer, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                        config.ssm_state_size, config.conv_kernel,
                        [config.num_key_value_heads if kind.startswith('full_attention') else 0 for kind in kinds])
    if moe:
        writer.add_nextn_predict_layers(1)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.moe_shared_expert_intermediate_size)
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_group_count(config.n_group)
        if config.moe_latent_size is not None:
            writer.add_moe_latent_size(config.moe_latent_size)


def save_gguf(variant: str, path: Path, quantize: bool = False) -> tuple[Path, str]:
    """A tiny random ``variant`` saved in ``path / 'hf'`` (rewritten with the values the file holds) and written to
    ``path / 'model.gguf'`` (projections as Q8_0 where ``quantize``)."""
    src = path / 'model.gguf'
    config = VARIANTS[variant]()
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if 'moe' in config.layers_block_type else gguf.MODEL_ARCH.NEMOTRON_H
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[arch])
    config.vocab_size = _add_tokenizer(writer)
    folder = save_random_model(config, str(path / 'hf'))
    config = hf_causal_lm(folder).config
    add_metadata(writer, config)
    write_gguf(writer, folder, quantize, lambda state: converter_arrays(config, state, arch))
    if arch == gguf.MODEL_ARCH.NEMOTRON_H_MOE:  # the next-token-prediction block's, left out
        for name in ('attn_norm', 'nextn.enorm'):
            writer.add_tensor(f'blk.{config.num_hidden_layers}.{name}.weight', np.ones(config.hidden_size, np.float32))
    finish(writer)
    return src, folder



@pytest.mark.parametrize('variant', ['mlp', 'moe_latent'])
def test_f32_file_is_the_checkpoint_and_matches_transformers(variant: str, tmp_path: Path) -> None:
    """Converted with every tensor dequantized, the folder is the checkpoint (config fields and every tensor bit for
    bit, ``A_log`` as the file holds it); the engine's 32 greedy tokens and first-step logits equal transformers'."""
    src, folder = save_gguf(variant, tmp_path)
    hf = hf_causal_lm(folder)
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    fields = ['architectures', 'model_type', 'num_hidden_layers', 'layers_block_type', 'num_key_value_heads',
              'head_dim', 'mamba_num_heads', 'mamba_head_dim', 'n_groups', 'ssm_state_size', 'conv_kernel',
              'use_conv_bias', 'use_bias', 'mlp_bias', 'tie_word_embeddings']
    if variant == 'mlp':
        fields.append('intermediate_size')
    else:
        fields += ['n_routed_experts', 'num_experts_per_tok', 'moe_intermediate_size',
                   'moe_shared_expert_intermediate_size', 'moe_latent_size', 'n_group', 'topk_group', 'norm_topk_prob',
                   'routed_scaling_factor']
    for field in fields:
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    assert converted.config.layer_norm_epsilon == pytest.approx(hf.config.layer_norm_epsilon, rel=1e-6)
    assert_same_state(converted, hf)
    vocab = hf.config.vocab_size
    assert_matches_transformers(str(src), hf, random_prompts([9, 70], seed=1, vocab=vocab),
                                random_prompts([5, 33], seed=2, vocab=vocab))


def test_q8_0_projections_stay_blocks_and_match_transformers(tmp_path: Path) -> None:
    """Every projection in Q8_0 (a model of every block kind): the attention blocks' q/k/v and output, the Mamba-2
    blocks' in and out projections, the MLP blocks' up and down, the MoE blocks' experts, shared experts and latent
    projections are held as their blocks (only the routers are dense). In fp32 the greedy tokens
    equal transformers' on the weights the blocks hold, batched as alone; every KV block and recurrent-state slot
    comes back."""
    src, folder = save_gguf('every_kind', tmp_path, quantize=True)
    hf = hf_causal_lm(folder)
    engine = make_engine(str(src))
    try:
        types = layer_types(engine.runner.model)
        experts = [f'experts.{e}.{proj}' for e in range(hf.config.n_routed_experts)
                   for proj in ('up_proj', 'down_proj')]
        own = {'linear_attention': ['in_proj', 'out_proj'], 'full_attention': ['qkv_proj', 'o_proj'],
               'mlp': ['up_proj', 'down_proj'], 'moe': ['shared_experts.up_proj', 'shared_experts.down_proj',
                                                        'fc1_latent_proj', 'fc2_latent_proj', *experts]}
        blocks = {f'layers.{i}.mixer.{name}' for i, kind in enumerate(hf.config.layers_block_type)
                  for name in own[kind]}
        assert {name for name, kind in types.items() if kind != 'dense'} == blocks
        assert {types[name] for name in blocks} == {'Q8_0'}
        prompts, batched = assert_batched_equals_solo_and_frees(engine, hf.config.vocab_size)
    finally:
        engine.close()
    assert_transformers_greedy(hf, prompts, batched)
