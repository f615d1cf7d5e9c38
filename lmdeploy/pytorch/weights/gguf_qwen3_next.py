"""Qwen3-Next (``qwen3next``), Qwen3.5 (``qwen35``) and Qwen3.5-MoE (``qwen35moe``) from GGUF: the hybrid decoders
of ``models/qwen3_next.py``. What convert_hf_to_gguf.py's ``Qwen3NextModel``, ``Qwen3_5TextModel`` and
``Qwen3_5MoeTextModel`` do to the tensors, undone here:

- Gemma-style norms stored as ``1 + weight`` (all but the linear attention's gated ``ssm_norm``);
- ``A_log`` stored as ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the convolution ``[C, 1, K]`` as
  ``[C, K]``;
- Qwen3-Next's ``in_proj_qkvz`` (q, k, v, z grouped by key head) split into ``attn_qkv`` (all q, all k, all v) and
  ``attn_gate`` (z); its ``in_proj_ba`` kept as ``ssm_ba``;
- Qwen3.5's value heads reordered from grouped by key head to tiled (``_LinearAttentionVReorderBase``) in the rows of
  ``in_proj_qkv`` (its v part), ``in_proj_z``, ``in_proj_a``/``_b``, in ``A_log``, ``dt_bias``, the convolution's v
  channels and the columns of ``out_proj``.

The last two only for a folder that transformers loads (no projections kept as blocks). For the engine the
projections stay as the file holds them (:data:`FILE_LAYOUT`): a column reorder of 128-feature value heads would cut
through Q4_K's and Q6_K's 256-input blocks, so the model reads Qwen3.5's value heads in the file's tiled order (value
head ``i`` on key head ``i % Hk``, as llama.cpp does), and Qwen3-Next's linear attention projects as Qwen3.5's does
(q/k/v and z apart: the file's ``attn_qkv`` and ``attn_gate``, of their own types; ``ssm_ba``, dense, split into its
b and a rows).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from gguf import Keys

from .gguf_keys import Meta, required

ARCHITECTURES = {'qwen3next': 'Qwen3NextForCausalLM', 'qwen35': 'Qwen3_5ForCausalLM',
                 'qwen35moe': 'Qwen3_5MoeForCausalLM'}
_MODEL_TYPES = {'qwen3next': 'qwen3_next', 'qwen35': 'qwen3_5_text', 'qwen35moe': 'qwen3_5_moe_text'}
# gguf-py 0.17's ``Keys`` lacks it; the converter writes it where the checkpoint lists ``layer_types``
RECURRENT_LAYERS = '{arch}.attention.recurrent_layers'
# the converter's default where a checkpoint has no ``full_attention_interval``
FULL_ATTENTION_INTERVAL = 4
# the config fields that have the engine's model read the linear attention as the files hold it
FILE_LAYOUT = {'qwen3next': {'linear_projections_split': True}, 'qwen35': {'linear_value_heads_tiled': True},
               'qwen35moe': {'linear_value_heads_tiled': True}}

LAYER_NAMES = {
    'attn_qkv': 'linear_attn.in_proj_qkv', 'attn_gate': 'linear_attn.in_proj_z', 'ssm_ba': 'linear_attn.in_proj_ba',
    'ssm_alpha': 'linear_attn.in_proj_a', 'ssm_beta': 'linear_attn.in_proj_b', 'ssm_dt.bias': 'linear_attn.dt_bias',
    'ssm_conv1d': 'linear_attn.conv1d', 'ssm_norm': 'linear_attn.norm', 'ssm_out': 'linear_attn.out_proj',
    'post_attention_norm': 'post_attention_layernorm', 'ffn_gate_inp_shexp': 'mlp.shared_expert_gate',
    'ffn_gate_shexp': 'mlp.shared_expert.gate_proj', 'ffn_up_shexp': 'mlp.shared_expert.up_proj',
    'ffn_down_shexp': 'mlp.shared_expert.down_proj',
}
# tensors llama.cpp names without a ``.weight``/``.bias`` kind
UNSUFFIXED_NAMES = {'ssm_a': 'linear_attn.A_log'}


def _layer_types(meta: Meta, layers: int) -> list[str]:
    """The file's ``recurrent_layers`` flags, else every ``full_attention_interval``-th layer full attention (as
    transformers' configs default their ``layer_types``)."""
    recurrent = meta(RECURRENT_LAYERS)
    if recurrent is None:
        interval = meta(Keys.LLM.FULL_ATTENTION_INTERVAL, FULL_ATTENTION_INTERVAL)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    return ['linear_attention' if flag else 'full_attention' for flag in recurrent[:layers]]


def hybrid_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any], arch: str) -> dict[str, Any]:
    """The hybrid decoder's fields: the linear attention's from ``ssm.*`` (``conv_kernel``, ``state_size``: key head
    dim, ``group_count``: key heads, ``time_step_rank``: value heads, ``inner_size``: value heads x value head dim),
    the rotary share of each head from ``rope.dimension_count``, Qwen3.5's interleaved M-RoPE sections; the
    next-token-prediction layers past the decoder's left out. The routing is the checkpoints' (softmax, top-k
    renormalized: llama.cpp's too)."""
    kernel, k_dim, k_heads, v_heads, inner, rotary = required(
        meta, Keys.SSM.CONV_KERNEL, Keys.SSM.STATE_SIZE, Keys.SSM.GROUP_COUNT, Keys.SSM.TIME_STEP_RANK,
        Keys.SSM.INNER_SIZE, Keys.Rope.DIMENSION_COUNT)
    layers = config['num_hidden_layers'] - meta(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)
    rope = {'rope_type': 'default', 'rope_theta': config['rope_theta'],
            'partial_rotary_factor': rotary / config['head_dim']}
    if arch != 'qwen3next':
        sections = required(meta, Keys.Rope.DIMENSION_SECTIONS)[0]
        rope |= {'mrope_section': list(sections[:3]), 'mrope_interleaved': True}
    fields = {'model_type': _MODEL_TYPES[arch], 'num_hidden_layers': layers, 'layer_types': _layer_types(meta, layers),
              'linear_conv_kernel_dim': kernel, 'linear_key_head_dim': k_dim, 'linear_num_key_heads': k_heads,
              'linear_num_value_heads': v_heads, 'linear_value_head_dim': inner // v_heads, 'rope_parameters': rope}
    if arch == 'qwen35':
        return fields
    experts, used, width = required(meta, Keys.LLM.EXPERT_COUNT, Keys.LLM.EXPERT_USED_COUNT,
                                     Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    fields |= {'num_experts': experts, 'num_experts_per_tok': used, 'moe_intermediate_size': width,
               'shared_expert_intermediate_size': meta(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)}
    if arch == 'qwen3next':  # Qwen3.5-MoE's router renormalizes by its design, without the field
        fields |= {'decoder_sparse_step': 1, 'mlp_only_layers': [], 'norm_topk_prob': True}
    return fields


def _tiled_to_grouped(tensor: torch.Tensor, dim: int, k_heads: int, head_dim: int) -> torch.Tensor:
    """Undo ``_reorder_v_heads``: value heads in ``dim`` from tiled ``[per_k, k_heads, head_dim]`` back to grouped
    by key head ``[k_heads, per_k, head_dim]``."""
    shape = list(tensor.shape)
    per_k = shape[dim] // (k_heads * head_dim)
    split = tensor.reshape(*shape[:dim], per_k, k_heads, head_dim, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape)


def _grouped_qkvz(qkv: torch.Tensor, z: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """Qwen3-Next's ``in_proj_qkvz``: per key head its q, k, v and z rows, from all q, all k, all v and z."""
    k_heads, key_size = config['linear_num_key_heads'], config['linear_num_key_heads'] * config['linear_key_head_dim']
    q, k, v = qkv.split([key_size, key_size, qkv.shape[0] - 2 * key_size])
    return torch.cat([part.reshape(k_heads, -1, qkv.shape[1]) for part in (q, k, v, z)], dim=1).flatten(0, 1)


def finish_hybrid(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Undo the converter's steps (see the module's docstring) on one group of converted tensors; with the
    :data:`FILE_LAYOUT` fields in ``config``, only those on dense tensors."""
    for name, value in state_dict.items():
        if name.endswith('norm.weight') and not name.endswith('linear_attn.norm.weight'):
            state_dict[name] = value - 1
        elif name.endswith('linear_attn.A_log'):
            state_dict[name] = torch.log(-value)
        elif name.endswith('linear_attn.conv1d.weight'):
            state_dict[name] = value.unsqueeze(1)
    if config.get('linear_projections_split'):
        _split_ba(state_dict, config)
    elif config['model_type'] == 'qwen3_next':
        gates = [name for name in state_dict if name.endswith('in_proj_z.weight')]
        for prefix in [name.removesuffix('in_proj_z.weight') for name in gates]:
            qkv, z = state_dict.pop(prefix + 'in_proj_qkv.weight'), state_dict.pop(prefix + 'in_proj_z.weight')
            state_dict[prefix + 'in_proj_qkvz.weight'] = _grouped_qkvz(qkv, z, config)
    elif config['linear_num_key_heads'] != config['linear_num_value_heads'] and not config.get(
            'linear_value_heads_tiled'):
        _grouped_value_heads(state_dict, config)


def _split_ba(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Qwen3-Next's ``in_proj_ba`` (per key head its b rows, then its a rows) as ``in_proj_b`` and ``in_proj_a``."""
    for prefix in [name.removesuffix('in_proj_ba.weight') for name in state_dict if name.endswith('in_proj_ba.weight')]:
        ba = state_dict.pop(prefix + 'in_proj_ba.weight')
        b, a = ba.view(config['linear_num_key_heads'], 2, -1, ba.shape[-1]).unbind(1)
        state_dict[prefix + 'in_proj_b.weight'] = b.flatten(0, 1)
        state_dict[prefix + 'in_proj_a.weight'] = a.flatten(0, 1)


def _grouped_value_heads(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    k_heads, v_dim = config['linear_num_key_heads'], config['linear_value_head_dim']
    key_channels = 2 * k_heads * config['linear_key_head_dim']
    for name, value in state_dict.items():
        if '.linear_attn.' not in name:
            continue
        if name.endswith(('in_proj_qkv.weight', 'conv1d.weight')):
            qk, v = value.split([key_channels, value.shape[0] - key_channels])
            state_dict[name] = torch.cat((qk, _tiled_to_grouped(v, 0, k_heads, v_dim)))
        elif name.endswith('in_proj_z.weight'):
            state_dict[name] = _tiled_to_grouped(value, 0, k_heads, v_dim)
        elif name.endswith(('in_proj_a.weight', 'in_proj_b.weight', 'A_log', 'dt_bias')):
            state_dict[name] = _tiled_to_grouped(value, 0, k_heads, 1)
        elif name.endswith('out_proj.weight'):
            state_dict[name] = _tiled_to_grouped(value, 1, k_heads, v_dim)


CONFIG_BUILDERS = {arch: partial(hybrid_config, arch=arch) for arch in ARCHITECTURES}
