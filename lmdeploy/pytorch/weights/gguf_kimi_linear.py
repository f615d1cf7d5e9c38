"""Kimi-Linear from GGUF (llama.cpp's ``kimi-linear``). What convert_hf_to_gguf.py's ``KimiLinearModel`` does,
undone here:

- ``attention.head_count_kv`` a value a layer: 0 for the KDA layers, 1 for the latent-attention ones (MLA run as
  multi-query attention over the latent), which gives ``layer_types``; ``kda.head_dim`` the KDA heads' width, whose
  count is the rows of ``ssm_beta`` (``b_proj``); the leading dense layers from ``leading_dense_block_count``;
- MLA's ``kv_b`` split into ``k_b`` (transposed) and ``v_b``, the experts stacked: ``deepseek2``'s steps;
- the q, k and v convolutions ``[C, K]`` stored as ``[1, C, 1, K]``, ``A_log [1, 1, H, 1]`` as ``ssm_a =
  -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``.

The file keeps no routing keys beyond the scaling: Kimi-Linear's router is a sigmoid with a correction bias over one
group, its top-k renormalized (the checkpoint's ``moe_renormalize``), as llama.cpp runs it. Registered in
``gguf_archs.py``."""
from __future__ import annotations

import re
from typing import Any

import torch
from gguf import Keys

from . import gguf_moe_archs
from .gguf_keys import Meta, required

ARCHITECTURES = {'kimi-linear': 'KimiLinearForCausalLM'}
_KDA_NAMES = {'ssm_conv1d_q': 'self_attn.q_conv1d', 'ssm_conv1d_k': 'self_attn.k_conv1d',
              'ssm_conv1d_v': 'self_attn.v_conv1d', 'ssm_f_a': 'self_attn.f_a_proj', 'ssm_f_b': 'self_attn.f_b_proj',
              'ssm_beta': 'self_attn.b_proj', 'ssm_g_a': 'self_attn.g_a_proj', 'ssm_g_b': 'self_attn.g_b_proj',
              'ssm_norm': 'self_attn.o_norm', 'ssm_dt.bias': 'self_attn.dt_bias'}
LAYER_NAMES = {'kimi-linear': {**gguf_moe_archs.LAYER_NAMES['deepseek2'], **_KDA_NAMES}}
# tensors llama.cpp names without a ``.weight``/``.bias`` kind
UNSUFFIXED_NAMES = {'kimi-linear': {'ssm_a': 'self_attn.A_log'}}
# an expert's dense weight as ``deepseek2``'s step names it, and its checkpoint name's part
_EXPERT_WEIGHT = re.compile(r'(.*)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight')
_EXPERT_PARTS = {'gate': 'w1', 'up': 'w3', 'down': 'w2'}


def _kimi_linear(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The latent attention's and experts' fields as ``deepseek2``'s, the layer kinds and KDA's shape (see the
    module's docstring)."""
    kv_heads, kernel, kda_dim = required(meta, Keys.Attention.HEAD_COUNT_KV, Keys.SSM.CONV_KERNEL, Keys.KDA.HEAD_DIM)
    layers = config['num_hidden_layers']
    if not isinstance(kv_heads, list) or len(kv_heads) != layers:
        raise ValueError(f'attention.head_count_kv should hold a value for each of the {layers} layers (0 for a KDA '
                         f'layer), not {kv_heads!r}')
    kda = [i for i, heads in enumerate(kv_heads) if not heads]
    beta = tensors.get(f'blk.{kda[0]}.ssm_beta.weight') if kda else None
    if beta is None:
        raise ValueError('no KDA layer with its ssm_beta tensor: the file is incomplete or its '
                         'attention.head_count_kv is wrong')
    fields = gguf_moe_archs.CONFIG_BUILDERS['deepseek2'](meta, tensors, config)
    dense = fields.pop('first_k_dense_replace')
    for name in ('model_type', 'architectures', 'topk_method', 'rope_parameters', 'n_routed_experts',
                 'norm_topk_prob'):
        fields.pop(name, None)
    return fields | {
        'model_type': 'kimi_linear', 'architectures': [ARCHITECTURES['kimi-linear']],
        'num_local_experts': meta(Keys.LLM.EXPERT_COUNT), 'norm_topk_prob': True,
        'layer_types': ['full_attention' if heads else 'linear_attention' for heads in kv_heads],
        'mlp_layer_types': ['dense' if i < dense else 'sparse' for i in range(layers)],
        'linear_conv_kernel_dim': kernel, 'linear_head_dim': kda_dim, 'linear_num_heads': int(beta.shape[-1])}


def finish_kimi_linear(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """After ``deepseek2``'s step (``gguf_tensors.py``), in place: the convolutions back to ``[C, 1, K]``,
    ``A_log`` from ``-exp(A_log)``, the dense experts under the checkpoint's names
    (``block_sparse_moe.experts.{e}.w1``...; experts kept as blocks stay the engine's ``mlp.experts``)."""
    for name in list(state_dict):
        expert = _EXPERT_WEIGHT.fullmatch(name)
        if expert is not None:
            prefix, index, part = expert.groups()
            state_dict[f'{prefix}.block_sparse_moe.experts.{index}.{_EXPERT_PARTS[part]}.weight'] = state_dict.pop(name)
    for name, value in state_dict.items():
        if name.endswith(('q_conv1d.weight', 'k_conv1d.weight', 'v_conv1d.weight')):
            state_dict[name] = value.reshape(value.shape[-3], 1, value.shape[-1])
        elif name.endswith('self_attn.A_log'):
            state_dict[name] = torch.log(-value)


CONFIG_BUILDERS = {'kimi-linear': _kimi_linear}
