"""Falcon-H1 from GGUF (llama.cpp's ``falcon-h1``): tiny random ``FalconH1ForCausalLM`` models with every µP
multiplier away from 1, written as convert_hf_to_gguf.py's ``FalconH1Model`` writes them: every multiplier folded into
the tensors (the MLP's gate and down, q/k/v with the key multiplier in k, the attention output, the Mamba-2 in
projection by ``ssm_in_multiplier`` and ``ssm_multipliers`` over its z/x/B/C/dt rows, its out projection, the
embeddings and the LM head), ``Mamba2Model``'s tensors (``-exp(A_log)``, ``D`` as ``[heads, 1]``, the convolution
squeezed, the gated norm ``[groups, inner / groups]``), q/k rows as they are, no multiplier among the keys. Read back,
the folder is the folded checkpoint bit for bit with every multiplier 1 (the engine folds nothing again) and serves
transformers' tokens of the original model; a Q8_0 file's projections are served as their blocks."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from test_falcon_h1 import falcon_h1_config
from test_gguf import _add_tokenizer, finish
from test_gguf_granitehybrid import mamba2_tensor, q8_0_values
from test_gguf_qwen3_next import layer_types
from transformers import AutoModelForCausalLM

from conftest import save_random_model
from family_checks import assert_matches_transformers, hf_causal_lm
from helpers import (assert_same_state, assert_transformers_greedy, dequantized_weight, make_engine, random_prompts,
                     run)

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf
from lmdeploy.pytorch.weights.gguf_hybrid import FALCON_H1_FOLDED

# the checkpoint's projections, which the Q8_0 file holds as blocks
PROJECTIONS = ('q_proj.weight', 'k_proj.weight', 'v_proj.weight', 'o_proj.weight', 'in_proj.weight', 'out_proj.weight',
               'gate_proj.weight', 'up_proj.weight', 'down_proj.weight')

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def folded(config, name: str, data: torch.Tensor) -> torch.Tensor:
    """``FalconH1Model.modify_tensors``' product of a checkpoint tensor and its multipliers (in fp32)."""
    gate, down = config.mlp_multipliers
    factor = {'down_proj': down, 'gate_proj': gate, 'o_proj': config.attention_out_multiplier,
              'k_proj': config.key_multiplier * config.attention_in_multiplier,
              'q_proj': config.attention_in_multiplier, 'v_proj': config.attention_in_multiplier,
              'out_proj': config.ssm_out_multiplier, 'in_proj': config.ssm_in_multiplier,
              'lm_head': config.lm_head_multiplier, 'embed_tokens': config.embedding_multiplier}
    module = next((key for key in factor if key in name), None)
    if module is None:
        return data
    data = data * factor[module]
    if module == 'in_proj':
        inner, groups = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
        sizes = [inner, inner, groups, groups, config.mamba_n_heads]
        rows = torch.cat([torch.full((size,), float(m)) for size, m in zip(sizes, config.ssm_multipliers)])
        data = data * rows[:, None]
    return data


def save_gguf(path: Path, quantize: bool = False, mup_key: bool = False, **variant) -> tuple[Path, str, str]:
    """A tiny random Falcon-H1 (``test_falcon_h1.falcon_h1_config(**variant)``) saved in ``path / 'hf'`` and written to
    ``path / 'model.gguf'`` (projections as Q8_0 where ``quantize``; with ``mup_key``, TII's pre-release converter's
    ``ssm.has_mup``); the file, the checkpoint, and ``path /
    'folded'``: the folded tensors with the values the file holds (the blocks', ``A_log`` through ``log(-(-exp))``)
    and every multiplier 1."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), 'falcon-h1')
    vocab = _add_tokenizer(writer)
    config = falcon_h1_config(**variant)
    config.vocab_size = vocab
    folder = save_random_model(config, str(path / 'hf'))
    config = hf_causal_lm(folder).config
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps), (writer.add_vocab_size, vocab),
                       (writer.add_ssm_conv_kernel, config.mamba_d_conv),
                       (writer.add_ssm_inner_size, config.mamba_d_ssm),
                       (writer.add_ssm_state_size, config.mamba_d_state),
                       (writer.add_ssm_time_step_rank, config.mamba_n_heads),
                       (writer.add_ssm_group_count, config.mamba_n_groups)]:
        add(value)
    if mup_key:
        writer.add_bool('falcon-h1.ssm.has_mup', True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, config.num_hidden_layers)
    folded_state = {}
    for name, tensor in load_file(str(Path(folder) / 'model.safetensors')).items():
        value = folded(config, name, tensor)
        file_name, data = mamba2_tensor(name, value, config.mamba_n_groups)
        array = np.ascontiguousarray(data.numpy())
        if quantize and name.endswith(PROJECTIONS):
            array, value = gguf.quants.quantize(array, Q.Q8_0), q8_0_values(value)
        writer.add_tensor(names.get_name(file_name, try_suffixes=('.weight', '.bias')), array,
                          raw_dtype=Q.Q8_0 if array.dtype == np.uint8 else None)
        folded_state[name] = torch.log(torch.exp(value)) if name.endswith('.A_log') else value
    finish(writer)
    reference = str(path / 'folded')
    config.update(FALCON_H1_FOLDED)
    config.save_pretrained(reference)
    save_file(folded_state, str(Path(reference) / 'model.safetensors'), metadata={'format': 'pt'})
    return src, folder, reference



def test_f32_file_is_the_folded_checkpoint_and_matches_transformers(tmp_path: Path) -> None:
    """With the gated norm: converted with every tensor dequantized, the folder is the folded checkpoint (every
    multiplier 1, every tensor bit for bit); the engine loads its weights unscaled (a second fold would scale them
    again) and gives transformers' 32 greedy tokens and first-step logits of the original model."""
    src, folder, reference = save_gguf(tmp_path, gate_norm='gate_then_norm')
    hf, folded_hf = hf_causal_lm(folder), hf_causal_lm(reference)
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    for field in ('architectures', 'model_type', 'head_dim', 'num_key_value_heads', 'mamba_d_ssm', 'mamba_n_heads',
                  'mamba_d_head', 'mamba_n_groups', 'mamba_d_state', 'mamba_d_conv', 'mamba_rms_norm',
                  'mamba_norm_before_gate', 'tie_word_embeddings', *FALCON_H1_FOLDED):
        assert getattr(converted.config, field) == getattr(folded_hf.config, field), field
    assert_same_state(converted, folded_hf)
    engine = make_engine(str(src))
    layer = engine.runner.model.layers[0]
    for module, name in ((layer.mlp.down_proj, 'feed_forward.down_proj'), (layer.mamba.in_proj, 'mamba.in_proj'),
                         (layer.self_attn.o_proj, 'self_attn.o_proj')):
        torch.testing.assert_close(dequantized_weight(module.kernel),
                                   folded_hf.get_parameter(f'model.layers.0.{name}.weight'), rtol=0, atol=0)
    vocab = hf.config.vocab_size
    assert_matches_transformers(str(src), hf, random_prompts([9, 70], seed=1, vocab=vocab),
                                random_prompts([5, 33], seed=2, vocab=vocab))


def test_q8_0_projections_stay_blocks_and_match_transformers(tmp_path: Path) -> None:
    """Every projection in Q8_0 (attention q/k/v and output, Mamba-2 in and out, the MLP) is held as its blocks, none
    refused for its multipliers; the greedy tokens equal transformers' on the weights the blocks hold (the folded
    checkpoint)."""
    src, _, reference = save_gguf(tmp_path, quantize=True)
    hf = hf_causal_lm(reference)
    engine = make_engine(str(src))
    types = layer_types(engine.runner.model)
    assert set(types.values()) == {'Q8_0'}, types
    assert {name for name in types if name.startswith('layers.1.')} == {
        f'layers.1.{name}' for name in ('self_attn.qkv_proj', 'self_attn.o_proj', 'mamba.in_proj', 'mamba.out_proj',
                                        'mlp.gate_up_proj', 'mlp.down_proj')}
    prompts = random_prompts([6, 41], seed=3, vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


def test_file_with_multipliers_among_its_keys_is_refused(tmp_path: Path) -> None:
    """TII's pre-release converter kept the multipliers as keys (``ssm.has_mup``, ``mlp_gate_multiplier``, ...), not
    known to be folded into its tensors: such a file is refused, saying to convert again, not served as if folded."""
    src, _, _ = save_gguf(tmp_path, mup_key=True)
    with pytest.raises(ConfigError, match='falcon-h1.ssm.has_mup'):
        resolve_gguf(str(src))
