"""LFM2 (``lfm2``) and LFM2-MoE (``lfm2moe``) from GGUF: the hybrid decoders of ``models/lfm2.py``. What
convert_hf_to_gguf.py's ``LFM2Model`` and ``LFM2MoeModel`` write, read back here:

- which layers are attention: a per-layer ``attention.head_count_kv``, 0 for the short-convolution layers;
- the MLP width after ``block_auto_adjust_ff_dim`` (``feed_forward_length``), so the config turns the adjustment off;
- the convolution ``[C, 1, K]`` stored as ``[C, K]`` (``shortconv.conv``), its taps in ``shortconv.l_cache``;
- the final norm (``model.embedding_norm``) as ``token_embd_norm``;
- LFM2-MoE's experts stacked per projection, its ``expert_bias`` as ``exp_probs_b.bias``, its dense first layers in
  ``leading_dense_block_count``; the routing (sigmoid, renormalized, unscaled) is fixed by llama.cpp, not written.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from gguf import Keys

from .gguf_keys import Meta

ARCHITECTURES = {'lfm2': 'Lfm2ForCausalLM', 'lfm2moe': 'Lfm2MoeForCausalLM'}
LAYER_NAMES = {'shortconv.conv': 'conv.conv', 'shortconv.in_proj': 'conv.in_proj',
               'shortconv.out_proj': 'conv.out_proj', 'exp_probs_b.bias': 'mlp.gate.e_score_correction_bias'}
LFM2_NORM_EPS = 1e-5  # the released configs' ``norm_eps``, where a file does not say


def lfm2_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any], arch: str) -> dict[str, Any]:
    """The decoder's fields: ``layer_types`` from the per-layer KV heads, the convolution's taps and bias, the MLP
    width as the file holds it; LFM2-MoE's experts and dense layers."""
    kv_heads = config['num_key_value_heads']
    kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * config['num_hidden_layers']
    l_cache = meta(Keys.ShortConv.L_CACHE)
    if l_cache is None:
        raise ValueError('missing GGUF metadata: shortconv.l_cache')
    if not any(kv_heads):
        raise ValueError('attention.head_count_kv names no attention layer (all 0)')
    conv_layer = kv_heads.index(0) if 0 in kv_heads else None
    fields = {'model_type': 'lfm2' if arch == 'lfm2' else 'lfm2_moe',
              'layer_types': ['conv' if heads == 0 else 'full_attention' for heads in kv_heads],
              'num_key_value_heads': max(kv_heads), 'conv_L_cache': l_cache,
              'conv_bias': conv_layer is not None and f'blk.{conv_layer}.shortconv.in_proj.bias' in tensors,
              'norm_eps': meta(Keys.Attention.LAYERNORM_RMS_EPS, LFM2_NORM_EPS), 'block_auto_adjust_ff_dim': False,
              'rope_parameters': {'rope_type': 'default', 'rope_theta': config['rope_theta']}}
    if arch == 'lfm2':
        return fields
    keys = (Keys.LLM.EXPERT_COUNT, Keys.LLM.EXPERT_USED_COUNT, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    experts, used, width = (meta(key) for key in keys)
    if None in (experts, used, width):
        missing = [key.replace('{arch}.', '') for key, value in zip(keys, (experts, used, width)) if value is None]
        raise ValueError(f'missing GGUF metadata: {", ".join(missing)}')
    dense = meta(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    return fields | {'num_experts': experts, 'num_experts_per_tok': used, 'moe_intermediate_size': width,
                     'num_dense_layers': dense, 'use_expert_bias': f'blk.{dense}.exp_probs_b.bias' in tensors,
                     'norm_topk_prob': True, 'routed_scaling_factor': 1.0}


def unsqueeze_conv(state_dict: dict[str, torch.Tensor]) -> None:
    """The convolutions' ``[C, K]`` back to the checkpoints' ``[C, 1, K]``."""
    for name, value in state_dict.items():
        if name.endswith('conv.conv.weight'):
            state_dict[name] = value.unsqueeze(1)


CONFIG_BUILDERS = {arch: partial(lfm2_config, arch=arch) for arch in ARCHITECTURES}
