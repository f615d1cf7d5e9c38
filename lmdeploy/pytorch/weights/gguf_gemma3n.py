"""Gemma 3n (``gemma3n``) from GGUF: the text model of ``models/gemma3n.py``. What convert_hf_to_gguf.py's
``Gemma3NModel`` writes, read back here:

- AltUp's embedding and unembedding projections stacked into one ``[altup_num_inputs - 1, H, H]`` tensor each
  (``altup_proj``, ``altup_unembd_proj``), split again;
- the MLP's sparsity as each layer's Gaussian quantile (``activation_sparsity_scale``, ``-inf`` for dense layers),
  turned back into ``activation_sparsity_pattern``; the sliding layers as a flag per layer;
- the per-layer inputs' width (``embedding_length_per_layer_input``), the KV-sharing layers (``shared_kv_layers``),
  AltUp's streams and active one; the LAuReL rank and the per-layer table's rows from their tensors;
- the norms as they are (Gemma 3n's scale by their weight: no ``1 + w`` shift).
"""
from __future__ import annotations

from typing import Any

import torch
from gguf import Keys

from .gguf_keys import Meta, required
from .gguf_keys import layer_types as _layer_types
from .gguf_keys import rope_parameters as _rope

ARCHITECTURES = {'gemma3n': 'Gemma3nForCausalLM'}
GLOBAL_NAMES = {'per_layer_token_embd': 'model.embed_tokens_per_layer',
                'per_layer_model_proj': 'model.per_layer_model_projection',
                'per_layer_proj_norm': 'model.per_layer_projection_norm', 'altup_proj': 'model.altup_projections',
                'altup_unembd_proj': 'model.altup_unembed_projections'}
LAYER_NAMES = {'post_attention_norm': 'post_attention_layernorm', 'ffn_norm': 'pre_feedforward_layernorm',
               'post_ffw_norm': 'post_feedforward_layernorm', 'inp_gate': 'per_layer_input_gate',
               'proj': 'per_layer_projection', 'post_norm': 'post_per_layer_input_norm',
               'altup_correct_coef': 'altup.correction_coefs',
               'altup_correct_scale.weight': 'altup.correct_output_scale',
               'altup_predict_coef': 'altup.prediction_coefs', 'altup_router': 'altup.modality_router',
               'altup_router_norm': 'altup.router_norm', 'laurel_l': 'laurel.linear_left',
               'laurel_r': 'laurel.linear_right', 'laurel_post_norm': 'laurel.post_laurel_norm'}
STACKED = ('model.altup_projections.weight', 'model.altup_unembed_projections.weight')


def gemma3n_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The text config's Gemma 3n fields from the file's keys and tensors (see the module's docstring)."""
    per_layer, shared, streams, active, scales = required(
        meta, Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, Keys.Attention.SHARED_KV_LAYERS, Keys.LLM.ALTUP_NUM_INPUTS,
        Keys.LLM.ALTUP_ACTIVE_IDX, Keys.LLM.ACTIVATION_SPARSITY_SCALE)
    layers = config['num_hidden_layers']
    sparsity = torch.distributions.Normal(0, 1).cdf(torch.tensor(scales, dtype=torch.float64))
    local = {'rope_type': 'default', 'rope_theta': meta(Keys.Rope.FREQ_BASE_SWA, 10000.0)}
    widths = config['intermediate_size']
    return {'model_type': 'gemma3n_text', 'hidden_size_per_layer_input': per_layer, 'num_kv_shared_layers': shared,
            'altup_num_inputs': streams, 'altup_active_idx': active,
            'activation_sparsity_pattern': [round(value, 6) for value in sparsity.tolist()],
            'intermediate_size': list(widths) if isinstance(widths, list) else [widths] * layers,
            'laurel_rank': int(tensors['blk.0.laurel_l.weight'].shape[-1]),
            'vocab_size_per_layer_input': int(tensors['per_layer_token_embd.weight'].shape[-1]),
            'sliding_window': meta(Keys.Attention.SLIDING_WINDOW),
            'layer_types': _layer_types(meta, layers, 5),
            'final_logit_softcapping': meta(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
            'rope_parameters': {'full_attention': _rope(meta, config['rope_theta']), 'sliding_attention': local}}


def split_altup(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """AltUp's stacked projections back into one tensor per stream after the first."""
    for name in STACKED:
        if name in state_dict:
            stacked = state_dict.pop(name)
            prefix = name.removesuffix('.weight')
            state_dict.update({f'{prefix}.{i}.weight': matrix for i, matrix in enumerate(stacked)})


CONFIG_BUILDERS = {'gemma3n': gemma3n_config}
FINISHERS = {'gemma3n': split_altup}
