"""Gemma 4 (``gemma4``) from GGUF: the text model of ``models/gemma4.py``. What convert_hf_to_gguf.py's
``Gemma4Model`` writes, read back here:

- the full layers' head width as ``attention.key_length``, the sliding layers' as ``attention.key_length_swa``;
  KV heads per layer (``attention.head_count_kv``, a list where ``num_global_key_value_heads`` differs), the MLP's
  width per layer (``feed_forward_length``, a list where the KV-sharing layers' is double: ``use_double_wide_mlp``);
  a full layer without an ``attn_v`` tensor takes its keys as values (``attention_k_eq_v``);
- the full layers' proportional rope as ``rope_freqs``: a divisor 1 for each turning frequency and 1e30 for the
  others, giving back ``partial_rotary_factor``; the sliding layers' base as ``rope.freq_base_swa``;
- the sliding layers as a flag per layer, the KV-sharing layers (``attention.shared_kv_layers``), the per-layer
  inputs' width (``embedding_length_per_layer_input``, 0: none) and their table's rows from its tensor;
- the MoE block: the router's ``scale`` as ``ffn_gate_inp.scale``, its ``per_expert_scale`` as
  ``ffn_down_exps.scale``, the stacked experts as ``ffn_gate_up_exps``/``ffn_down_exps`` (as the checkpoints stack
  them), ``layer_scalar`` as ``layer_output_scale``;
- the norms as they are (Gemma 4's scale by their weight: no ``1 + w`` shift).
Every tensor is dequantized at load.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import Keys

from .gguf_keys import Meta, required
from .gguf_keys import layer_types as _layer_types
from .gguf_keys import rope_parameters as _rope
from .gguf_rope import ROPE_FREQS

ARCHITECTURES = {'gemma4': 'Gemma4ForCausalLM'}
GLOBAL_NAMES = {'per_layer_token_embd': 'model.embed_tokens_per_layer',
                'per_layer_model_proj': 'model.per_layer_model_projection',
                'per_layer_proj_norm': 'model.per_layer_projection_norm'}
LAYER_NAMES = {'post_attention_norm': 'post_attention_layernorm', 'ffn_norm': 'pre_feedforward_layernorm',
               'post_ffw_norm': 'post_feedforward_layernorm', 'pre_ffw_norm_2': 'pre_feedforward_layernorm_2',
               'post_ffw_norm_1': 'post_feedforward_layernorm_1', 'post_ffw_norm_2': 'post_feedforward_layernorm_2',
               'inp_gate': 'per_layer_input_gate', 'proj': 'per_layer_projection',
               'post_norm': 'post_per_layer_input_norm', 'layer_output_scale.weight': 'layer_scalar',
               'ffn_gate_inp': 'router.proj', 'ffn_gate_up_exps.weight': 'experts.gate_up_proj',
               'ffn_down_exps.weight': 'experts.down_proj'}
# tensors the converter names with a kind other than weight or bias
UNSUFFIXED_NAMES = {'ffn_gate_inp.scale': 'router.scale', 'ffn_down_exps.scale': 'router.per_expert_scale'}
UNROTATED_DIVISOR = 1e30  # the converter's rope_freqs entry of a frequency that does not turn


def per_layer(value: int | list[int], layers: int) -> list[int]:
    """A per-layer key as a list (one value for every layer where the file holds one)."""
    return list(value) if isinstance(value, list) else [value] * layers


def gemma4_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The text config's Gemma 4 fields from the file's keys and tensors (see the module's docstring)."""
    full_dim, sliding_dim, shared, per_layer_width = required(
        meta, Keys.Attention.KEY_LENGTH, Keys.Attention.KEY_LENGTH_SWA, Keys.Attention.SHARED_KV_LAYERS,
        Keys.LLM.EMBD_LENGTH_PER_LAYER_INP)
    layers = config['num_hidden_layers']
    kinds = _layer_types(meta, layers, 6)
    full, sliding = kinds.index('full_attention'), kinds.index('sliding_attention')
    kv_heads = per_layer(config['num_key_value_heads'], layers)
    widths = per_layer(config['intermediate_size'], layers)
    if ROPE_FREQS not in tensors:
        raise ValueError(f'a gemma4 file without {ROPE_FREQS} (the full layers\' proportional rope)')
    divisors = np.asarray(tensors[ROPE_FREQS].data)
    rotary = {'rope_type': 'proportional', 'rope_theta': config['rope_theta'],
              'partial_rotary_factor': float((divisors < UNROTATED_DIVISOR).sum() * 2 / full_dim)}
    experts = meta(Keys.LLM.EXPERT_COUNT)
    fields = {'model_type': 'gemma4_text', 'head_dim': sliding_dim, 'global_head_dim': full_dim,
              'num_key_value_heads': kv_heads[sliding], 'num_global_key_value_heads': kv_heads[full],
              'attention_k_eq_v': f'blk.{full}.attn_v.weight' not in tensors,
              'intermediate_size': widths[0], 'use_double_wide_mlp': widths[-1] == 2 * widths[0] and shared > 0,
              'num_kv_shared_layers': shared, 'hidden_size_per_layer_input': per_layer_width,
              'sliding_window': meta(Keys.Attention.SLIDING_WINDOW), 'layer_types': kinds,
              'final_logit_softcapping': meta(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
              'rope_parameters': {'full_attention': rotary,
                                  'sliding_attention': {'rope_type': 'default',
                                                        'rope_theta': meta(Keys.Rope.FREQ_BASE_SWA, 10000.0)}}}
    if _rope(meta, config['rope_theta'])['rope_type'] != 'default':
        raise ValueError('a gemma4 file with rope scaling is not supported')
    if per_layer_width:
        fields['vocab_size_per_layer_input'] = int(tensors['per_layer_token_embd.weight'].shape[-1])
    if experts:
        fields |= {'enable_moe_block': True, 'num_experts': experts, 'top_k_experts': meta(Keys.LLM.EXPERT_USED_COUNT),
                   'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)}
    return fields


CONFIG_BUILDERS = {'gemma4': gemma4_config}
