"""Mamba and Falcon Mamba (``mamba``) and Jamba (``jamba``) from GGUF: the Mamba-1 decoders of ``models/mamba.py`` and
``models/jamba.py``. What convert_hf_to_gguf.py's ``MambaModel`` writes, read back here:

- no attention: ``attention.head_count`` and ``feed_forward_length`` 0, a context of 2**20 (arbitrary: the engine's
  4096 for the checkpoints, which name none, is taken instead);
- the mixer's sizes as ``ssm.*`` keys (``time_step_rank`` is dt's rank), Falcon Mamba told apart by
  ``ssm.dt_b_c_rms`` (its weightless norms on dt, B and C; their epsilon is not written: Falcon Mamba's configs' 1e-6);
- ``A_log`` stored as ``ssm_a = -exp(A_log)`` and ``D`` as ``ssm_d``, without a ``.weight``; the convolution
  ``[C, 1, K]`` as ``[C, K]``; the block's norm as ``attn_norm``; the LM head left out where tied.

``JambaModel`` writes the same mixer tensors (and Jamba's dt/B/C norms as ``ssm_dt_norm``, ``ssm_b_norm``,
``ssm_c_norm``), the attention layers as a per-layer ``attention.head_count_kv`` (0 for a Mamba layer), the MoE layers'
experts stacked (``ffn_*_exps``, router ``ffn_gate_inp``) and no ``attn_layer_*``/``expert_layer_*`` keys: the periods
and offsets are read back from which layers hold attention and experts.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from gguf import Keys

from .gguf_keys import Meta, required

ARCHITECTURES = {'mamba': 'MambaForCausalLM', 'jamba': 'JambaForCausalLM'}


def _mixer_names(mixer: str) -> dict[str, str]:
    return {'ssm_in': f'{mixer}.in_proj', 'ssm_conv1d': f'{mixer}.conv1d', 'ssm_x': f'{mixer}.x_proj',
            'ssm_dt': f'{mixer}.dt_proj', 'ssm_out': f'{mixer}.out_proj'}


LAYER_NAMES = {'mamba': {'attn_norm': 'norm', **_mixer_names('mixer')},
               'jamba': {**_mixer_names('mamba'), 'ssm_dt_norm': 'mamba.dt_layernorm',
                         'ssm_b_norm': 'mamba.b_layernorm', 'ssm_c_norm': 'mamba.c_layernorm',
                         'ffn_norm': 'pre_ff_layernorm', 'ffn_gate_inp': 'feed_forward.router',
                         'ffn_gate': 'feed_forward.gate_proj', 'ffn_up': 'feed_forward.up_proj',
                         'ffn_down': 'feed_forward.down_proj', 'ffn_gate_exps': 'feed_forward.experts.gate_proj',
                         'ffn_up_exps': 'feed_forward.experts.up_proj',
                         'ffn_down_exps': 'feed_forward.experts.down_proj'}}
# tensors llama.cpp names without a ``.weight``/``.bias`` kind
UNSUFFIXED_NAMES = {'mamba': {'ssm_a': 'mixer.A_log', 'ssm_d': 'mixer.D'},
                    'jamba': {'ssm_a': 'mamba.A_log', 'ssm_d': 'mamba.D'}}
FALCON_MAMBA_MIXER_EPS = 1e-6
# the converter writes an arbitrary context of 2**20; the checkpoints name none and the engine takes 4096 for them
MAMBA_CONTEXT = 4096


def mamba_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The Mamba-1 blocks' fields; no attention heads (the file's 0 are not heads) and the checkpoints' context, not
    the file's arbitrary one."""
    kernel, inner, state, rank = required(meta, Keys.SSM.CONV_KERNEL, Keys.SSM.INNER_SIZE, Keys.SSM.STATE_SIZE,
                                          Keys.SSM.TIME_STEP_RANK)
    falcon = bool(meta(Keys.SSM.DT_B_C_RMS, False))
    fields = {'model_type': 'falcon_mamba' if falcon else 'mamba',
              'architectures': ['FalconMambaForCausalLM' if falcon else 'MambaForCausalLM'],
              'num_attention_heads': None, 'num_key_value_heads': None, 'head_dim': None,
              'max_position_embeddings': MAMBA_CONTEXT,
              'intermediate_size': inner, 'expand': inner // config['hidden_size'], 'state_size': state,
              'conv_kernel': kernel, 'time_step_rank': rank, 'layer_norm_epsilon': config['rms_norm_eps'],
              'use_conv_bias': 'blk.0.ssm_conv1d.bias' in tensors, 'use_bias': 'blk.0.ssm_in.bias' in tensors}
    return fields | ({'mixer_rms_eps': FALCON_MAMBA_MIXER_EPS} if falcon else {})


def _period(layers: list[int], count: int, what: str) -> tuple[int, int]:
    """The ``(period, offset)`` that picks exactly ``layers`` of ``count``, as Jamba's config gives them."""
    if not layers:
        period, offset = count + 1, count
    elif len(layers) == 1:
        period, offset = count, layers[0]
    else:
        period, offset = layers[1] - layers[0], layers[0] % (layers[1] - layers[0])
    if [i for i in range(count) if i % period == offset] != layers:
        raise ValueError(f'its {what} layers {layers} are not one in every n layers, as Jamba\'s are')
    return period, offset


def jamba_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Jamba's fields: the Mamba-1 layers' sizes; attention where the per-layer KV heads are not 0, experts where a
    layer holds a router, each as a period and an offset."""
    layers = config['num_hidden_layers']
    kernel, inner, state, rank = required(meta, Keys.SSM.CONV_KERNEL, Keys.SSM.INNER_SIZE, Keys.SSM.STATE_SIZE,
                                          Keys.SSM.TIME_STEP_RANK)
    kv_heads = config['num_key_value_heads']
    kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * layers
    attn_period, attn_offset = _period([i for i in range(layers) if kv_heads[i]], layers, 'attention')
    moe_layers = [i for i in range(layers) if f'blk.{i}.ffn_gate_inp.weight' in tensors]
    expert_period, expert_offset = _period(moe_layers, layers, 'expert')
    mamba = next((i for i in range(layers) if not kv_heads[i]), 0)
    return {'model_type': 'jamba', 'num_key_value_heads': max(kv_heads) or config['num_attention_heads'],
            'attn_layer_period': attn_period, 'attn_layer_offset': attn_offset,
            'expert_layer_period': expert_period, 'expert_layer_offset': expert_offset,
            'num_experts': meta(Keys.LLM.EXPERT_COUNT, 1) if moe_layers else 1,
            'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT, 1) if moe_layers else 1,
            'mamba_d_state': state, 'mamba_d_conv': kernel, 'mamba_expand': inner // config['hidden_size'],
            'mamba_dt_rank': rank, 'mamba_conv_bias': f'blk.{mamba}.ssm_conv1d.bias' in tensors,
            'mamba_proj_bias': f'blk.{mamba}.ssm_in.bias' in tensors}


CONFIG_BUILDERS = {'mamba': mamba_config, 'jamba': jamba_config}


def finish_mamba(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """``A_log`` and the convolution as the checkpoints hold them, under their ``backbone.`` names."""
    for name in list(state_dict):
        value = state_dict.pop(name)
        if name.endswith('.A_log'):
            value = torch.log(-value)
        elif name.endswith('.conv1d.weight'):
            value = value.unsqueeze(1)
        for old, new in (('model.embed_tokens.', 'backbone.embeddings.'), ('model.norm.', 'backbone.norm_f.'),
                         ('model.layers.', 'backbone.layers.')):
            if name.startswith(old):
                name = new + name[len(old):]
        state_dict[name] = value


_STACKED = re.compile(r'(.*\.feed_forward\.experts)\.(\w+_proj\.weight)')


def finish_jamba(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """On one group of converted tensors: ``A_log`` and the convolution as the checkpoints hold them, the stacked
    experts one tensor per expert and the final norm under its name."""
    for name in list(state_dict):
        value = state_dict[name]
        if name.endswith('.A_log'):
            state_dict[name] = torch.log(-value)
        elif name.endswith('.conv1d.weight'):
            state_dict[name] = value.unsqueeze(1)
        elif match := _STACKED.fullmatch(name):
            for expert, part in enumerate(state_dict.pop(name)):
                state_dict[f'{match[1]}.{expert}.{match[2]}'] = part.clone()
    if 'model.norm.weight' in state_dict:  # in the group of the global tensors
        state_dict['model.final_layernorm.weight'] = state_dict.pop('model.norm.weight')


FINISHERS = {'mamba': finish_mamba, 'jamba': finish_jamba}
