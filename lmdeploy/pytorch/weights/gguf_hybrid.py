"""Granite 4.0-H (``granitehybrid``), Nemotron-H (``nemotron_h``, ``nemotron_h_moe``) and Falcon-H1 (``falcon-h1``) from
GGUF: the Mamba-2 hybrid decoders of ``models/granitemoehybrid.py``, ``models/nemotron_h.py`` and
``models/falcon_h1.py``; Falcon-H1's converter also folds every µP multiplier into the tensors, which the config
then holds as 1. What convert_hf_to_gguf.py's
``GraniteHybridModel`` and ``NemotronHModel`` (both on ``Mamba2Model``'s tensors) do, undone here:

- ``A_log`` stored as ``ssm_a = -exp(A_log)`` and ``D`` as ``ssm_d``, both ``[heads, 1]`` and without a ``.weight``;
  ``dt_bias`` as ``ssm_dt.bias``; the convolution ``[C, 1, K]`` as ``[C, K]``; the gated norm ``[inner]`` as
  ``[groups, inner / groups]``;
- the attention layers' q/k rows permuted as Llama's (both set ``undo_permute``; neither rotates but a Bamba file);
- Granite's stacked MoE ``input_linear`` split into ``ffn_gate_exps`` and ``ffn_up_exps``, its shared MLP's
  ``input_linear`` into ``ffn_gate_shexp`` and ``ffn_up_shexp`` (``ffn_gate``/``ffn_up``/``ffn_down`` without
  experts), the router as ``ffn_gate_inp``;
- Nemotron-H's per-expert MLPs stacked (``ffn_up_exps``, ``ffn_down_exps``); its tensors under ``model.`` rather than
  the checkpoints' ``backbone.``.

The layer kinds come from the tensors each block holds (llama.cpp reads them from the per-layer ``head_count_kv``
and ``feed_forward_length`` arrays, which say the same). A folder without layers kept as blocks is the checkpoint
that transformers loads; one with them names the MoE and shared-MLP tensors as the engine's model does, so that
the experts' and the shared MLP's gate and up stay apart as the file holds them.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from gguf import Keys

from .gguf_keys import Meta, required

ARCHITECTURES = {'granitehybrid': 'GraniteMoeHybridForCausalLM', 'nemotron_h': 'NemotronHForCausalLM',
                 'nemotron_h_moe': 'NemotronHForCausalLM', 'falcon-h1': 'FalconH1ForCausalLM'}
# the converter permutes the attention layers' q/k rows as Llama's (``undo_permute``); Falcon-H1's it leaves (llama.cpp
# turns halves, as Falcon-H1 does)
PERMUTED_ARCHS = ('granitehybrid', 'nemotron_h', 'nemotron_h_moe')
_MIXERS = {'granitehybrid': 'mamba', 'nemotron_h': 'mixer', 'nemotron_h_moe': 'mixer', 'falcon-h1': 'mamba'}


def _mamba2_names(mixer: str) -> dict[str, str]:
    return {'ssm_in': f'{mixer}.in_proj', 'ssm_conv1d': f'{mixer}.conv1d', 'ssm_dt.bias': f'{mixer}.dt_bias',
            'ssm_norm': f'{mixer}.norm', 'ssm_out': f'{mixer}.out_proj'}


_NEMOTRON_NAMES = {**_mamba2_names('mixer'), 'attn_norm': 'norm', 'attn_q': 'mixer.q_proj', 'attn_k': 'mixer.k_proj',
                   'attn_v': 'mixer.v_proj', 'attn_output': 'mixer.o_proj', 'ffn_up': 'mixer.up_proj',
                   'ffn_down': 'mixer.down_proj'}
_SHARED_MLP = {'gate': 'shared_mlp.gate_proj', 'up': 'shared_mlp.up_proj', 'down': 'shared_mlp.down_proj'}
# layer tensor names by ``module`` or ``module.kind`` (see ``gguf_archs.LAYER_NAMES``); the rest are gguf.py's
LAYER_NAMES: dict[str, dict[str, str]] = {
    # the shared MLP is ``ffn_*`` in a file without experts, ``ffn_*_shexp`` beside them
    'granitehybrid': {**_mamba2_names('mamba'), **{f'ffn_{proj}': name for proj, name in _SHARED_MLP.items()},
                      **{f'ffn_{proj}_shexp': name for proj, name in _SHARED_MLP.items()}},
    'nemotron_h': _NEMOTRON_NAMES,
    # the MLP and its norm under the engine's names (``finish_falcon_h1`` gives the checkpoint's where dense)
    'falcon-h1': _mamba2_names('mamba'),
    'nemotron_h_moe': {**_NEMOTRON_NAMES, 'ffn_gate_inp': 'mixer.gate',
                       'exp_probs_b.bias': 'mixer.gate.e_score_correction_bias',
                       'ffn_up_exps': 'mixer.experts.up_proj', 'ffn_down_exps': 'mixer.experts.down_proj',
                       'ffn_up_shexp': 'mixer.shared_experts.up_proj',
                       'ffn_down_shexp': 'mixer.shared_experts.down_proj',
                       'ffn_latent_down': 'mixer.fc1_latent_proj', 'ffn_latent_up': 'mixer.fc2_latent_proj'},
}
# tensors llama.cpp names without a ``.weight``/``.bias`` kind
UNSUFFIXED_NAMES = {arch: {'ssm_a': f'{mixer}.A_log', 'ssm_d': f'{mixer}.D'} for arch, mixer in _MIXERS.items()}
# gguf-py maps Falcon-H1's ``pre_ff_layernorm.weight`` whole, to ``ffn_norm`` without a kind, as llama.cpp reads it
UNSUFFIXED_NAMES['falcon-h1']['ffn_norm'] = 'post_attention_layernorm.weight'


def _rows(tensors: dict[str, Any], layers: int, module: str) -> int | None:
    """The output rows of the first layer's ``module`` weight (ggml order: inputs first; experts last)."""
    for index in range(layers):
        tensor = tensors.get(f'blk.{index}.{module}.weight')
        if tensor is not None:
            return int(tensor.shape[1])
    return None


def _has(tensors: dict[str, Any], index: int, module: str, kind: str = 'weight') -> bool:
    return f'blk.{index}.{module}.{kind}' in tensors


def _mamba2(meta: Meta, tensors: dict[str, Any], layers: int) -> dict[str, Any]:
    """The Mamba-2 layers' sizes: ``ssm.time_step_rank`` heads of ``ssm.inner_size`` / heads features,
    ``ssm.group_count`` B/C groups of ``ssm.state_size``, a convolution of ``ssm.conv_kernel``; their biases as the
    tensors have them."""
    kernel, state, groups, heads, inner = required(meta, Keys.SSM.CONV_KERNEL, Keys.SSM.STATE_SIZE,
                                                    Keys.SSM.GROUP_COUNT, Keys.SSM.TIME_STEP_RANK, Keys.SSM.INNER_SIZE)
    mamba = [i for i in range(layers) if _has(tensors, i, 'ssm_in')]
    first = mamba[0] if mamba else 0
    return {'kernel': kernel, 'state': state, 'groups': groups, 'heads': heads, 'head_dim': inner // heads,
            'conv_bias': _has(tensors, first, 'ssm_conv1d', 'bias'),
            'proj_bias': _has(tensors, first, 'ssm_in', 'bias'),
            'mamba_layers': mamba}


def _attention(tensors: dict[str, Any], config: dict[str, Any], layers: int, meta: Meta) -> dict[str, Any]:
    """The attention layers' key/value heads (the largest of the per-layer ``head_count_kv``, 0 on the other layers)
    and head width (``key_length``, else hidden / heads as llama.cpp takes it)."""
    kv_heads = config['num_key_value_heads']
    if isinstance(kv_heads, list):
        kv_heads = max(kv_heads[:layers], default=0) or config['num_attention_heads']
    return {'num_key_value_heads': kv_heads,
            'head_dim': meta(Keys.Attention.KEY_LENGTH) or config['hidden_size'] // config['num_attention_heads'],
            'attention_bias': any(_has(tensors, i, 'attn_q', 'bias') for i in range(layers))}


def granite_hybrid_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0-H: Granite's multipliers (llama.cpp's defaults where absent), rotary unless the file's
    ``rope.scaling.finetuned`` is false (llama.cpp's switch, on where absent; the converter sets it for Bamba only:
    Granite 4.0-H has no positions), routed experts with the shared MLP where the file has a router, else the shared
    MLP alone (its ``ffn_*``). A file whose rotary turns part of each head is Bamba's (:func:`_bamba_config`)."""
    layers = config['num_hidden_layers']
    mamba = _mamba2(meta, tensors, layers)
    attention = _attention(tensors, config, layers, meta)
    head_dim = config['hidden_size'] // config['num_attention_heads']
    if attention['head_dim'] != head_dim:
        raise ValueError(f'a granitehybrid file whose attention heads are {attention["head_dim"]} wide (not hidden / '
                         f'heads, {head_dim}) is not supported')
    rotary = bool(meta(Keys.Rope.SCALING_FINETUNED, True))
    experts = meta(Keys.LLM.EXPERT_COUNT, 0) if any(_has(tensors, i, 'ffn_gate_inp') for i in range(layers)) else 0
    if rotary and meta(Keys.Rope.DIMENSION_COUNT, head_dim) != head_dim:
        return _bamba_config(meta, tensors, config, mamba, attention, experts)
    shared = _rows(tensors, layers, 'ffn_up_shexp' if experts else 'ffn_up')
    return {'model_type': 'granitemoehybrid', 'num_key_value_heads': attention['num_key_value_heads'],
            'head_dim': head_dim, 'attention_bias': attention['attention_bias'],
            'layer_types': ['mamba' if i in mamba['mamba_layers'] else 'attention' for i in range(layers)],
            'position_embedding_type': 'rope' if rotary else 'nope',
            'rope_parameters': {'rope_type': 'default', 'rope_theta': config['rope_theta']},
            'attention_multiplier': meta(Keys.Attention.SCALE) or head_dim**-0.5,
            'embedding_multiplier': meta(Keys.LLM.EMBEDDING_SCALE) or 1.0,
            'residual_multiplier': meta(Keys.LLM.RESIDUAL_SCALE) or 1.0,
            'logits_scaling': meta(Keys.LLM.LOGIT_SCALE) or 1.0,
            'num_local_experts': experts, 'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT, 0),
            'intermediate_size': _rows(tensors, layers, 'ffn_up_exps') or shared, 'shared_intermediate_size': shared,
            'hidden_act': 'silu', 'mamba_n_heads': mamba['heads'], 'mamba_d_head': mamba['head_dim'],
            'mamba_n_groups': mamba['groups'], 'mamba_d_state': mamba['state'], 'mamba_d_conv': mamba['kernel'],
            'mamba_expand': mamba['heads'] * mamba['head_dim'] // config['hidden_size'],
            'mamba_conv_bias': mamba['conv_bias'], 'mamba_proj_bias': mamba['proj_bias']}


_GRANITE_SCALES = (Keys.Attention.SCALE, Keys.LLM.EMBEDDING_SCALE, Keys.LLM.RESIDUAL_SCALE, Keys.LLM.LOGIT_SCALE)


def _bamba_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any], mamba: dict[str, Any],
                  attention: dict[str, Any], experts: int) -> dict[str, Any]:
    """Bamba (the converter's ``BambaForCausalLM``: rotary over ``rope.dimension_count``, the checkpoint's
    ``attn_rotary_emb``, half of each head as transformers' Bamba turns it; no experts, no multipliers): its own
    config, whose attention layers are those without Mamba-2 tensors; other partial rotaries are refused."""
    head_dim, rope_dim = attention['head_dim'], meta(Keys.Rope.DIMENSION_COUNT)
    if experts or any(meta(key) is not None for key in _GRANITE_SCALES):
        raise ValueError('a granitehybrid file with partial rotary (rope.dimension_count below the head width) and '
                         'experts or Granite multipliers is not supported: only Bamba has partial rotary')
    if 2 * rope_dim != head_dim:
        raise ValueError(f'a granitehybrid file whose rotary turns {rope_dim} of its {head_dim} head features is not '
                         f'supported: Bamba turns half of them')
    layers = config['num_hidden_layers']
    return {'model_type': 'bamba', 'architectures': ['BambaForCausalLM'], 'head_dim': head_dim,
            'num_key_value_heads': attention['num_key_value_heads'], 'attention_bias': attention['attention_bias'],
            'attn_layer_indices': [i for i in range(layers) if i not in mamba['mamba_layers']],
            'rope_parameters': {'rope_type': 'default', 'rope_theta': config['rope_theta'],
                                'partial_rotary_factor': 0.5},
            'intermediate_size': _rows(tensors, layers, 'ffn_up'), 'mlp_bias': _has(tensors, 0, 'ffn_up', 'bias'),
            'hidden_act': 'silu', 'mamba_n_heads': mamba['heads'], 'mamba_d_head': mamba['head_dim'],
            'mamba_n_groups': mamba['groups'], 'mamba_d_state': mamba['state'], 'mamba_d_conv': mamba['kernel'],
            'mamba_expand': mamba['heads'] * mamba['head_dim'] // config['hidden_size'],
            'mamba_conv_bias': mamba['conv_bias'], 'mamba_proj_bias': mamba['proj_bias']}


def _nemotron_block(tensors: dict[str, Any], index: int) -> str:
    """A Nemotron-H block's kind as ``hybrid_override_pattern`` writes it: ``M`` Mamba-2, ``*`` attention, ``E``
    MoE, ``-`` MLP."""
    for module, kind in (('ssm_in', 'M'), ('attn_q', '*'), ('ffn_gate_inp', 'E'), ('ffn_up', '-')):
        if _has(tensors, index, module):
            return kind
    raise ValueError(f'blk.{index} holds none of a Mamba-2, attention, MLP or MoE block\'s tensors')


def nemotron_h_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H: attention without positions; the norms' epsilon from ``layer_norm_rms_epsilon`` (else
    ``layer_norm_epsilon``); the MoE blocks' routing from the expert keys (sigmoid over the experts with the
    correction bias, llama.cpp's fixed routing for it, which takes no groups: every group kept where the file names
    no ``expert_group_used_count``); the next-token-prediction block past the decoder's left out."""
    layers = config['num_hidden_layers'] - meta(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)
    mamba = _mamba2(meta, tensors, layers)
    pattern = ''.join(_nemotron_block(tensors, i) for i in range(layers))
    fields = {'model_type': 'nemotron_h', 'num_hidden_layers': layers, 'hybrid_override_pattern': pattern,
              **_attention(tensors, config, layers, meta),
              'layer_norm_epsilon': meta(Keys.Attention.LAYERNORM_RMS_EPS) or meta(Keys.Attention.LAYERNORM_EPS, 1e-5),
              'intermediate_size': _rows(tensors, layers, 'ffn_up') or 0,
              'mlp_bias': any(_has(tensors, i, 'ffn_up', 'bias') or _has(tensors, i, 'ffn_up_exps', 'bias')
                              for i in range(layers)),
              'mamba_num_heads': mamba['heads'], 'mamba_head_dim': mamba['head_dim'], 'n_groups': mamba['groups'],
              'ssm_state_size': mamba['state'], 'conv_kernel': mamba['kernel'], 'use_conv_bias': mamba['conv_bias'],
              'use_bias': mamba['proj_bias'], 'mamba_proj_bias': mamba['proj_bias']}
    if 'E' not in pattern:
        return fields
    experts, used = required(meta, Keys.LLM.EXPERT_COUNT, Keys.LLM.EXPERT_USED_COUNT)
    groups = meta(Keys.LLM.EXPERT_GROUP_COUNT, 1)
    latent = _rows(tensors, layers, 'ffn_latent_down')
    if 'quantization_config' in config:
        fields['quantization_config'] = _per_expert_types(config['quantization_config'], experts)
    return fields | {'n_routed_experts': experts, 'num_experts_per_tok': used,
                     'moe_intermediate_size': _rows(tensors, layers, 'ffn_up_exps'),
                     'moe_shared_expert_intermediate_size': _rows(tensors, layers, 'ffn_up_shexp'),
                     'n_shared_experts': meta(Keys.LLM.EXPERT_SHARED_COUNT, 1), 'moe_latent_size': latent,
                     'n_group': groups, 'topk_group': meta(Keys.LLM.EXPERT_GROUP_USED_COUNT, groups),
                     'routed_scaling_factor': meta(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
                     'norm_topk_prob': bool(meta(Keys.LLM.EXPERT_WEIGHTS_NORM, False))}


_STACKED_EXPERTS = re.compile(r'(layers\.\d+\.mixer\.experts)\.(\w+)')


def _per_expert_types(quantization: dict[str, Any], experts: int) -> dict[str, Any]:
    """Nemotron-H's routed experts kept as blocks (``layers.3.mixer.experts.up_proj``: the file's stacked tensor) named
    per expert too, as the engine's linear layers are (``layers.3.mixer.experts.5.up_proj``)."""
    types = dict(quantization['ggml_types'])
    for name, ggml_type in quantization['ggml_types'].items():
        if match := _STACKED_EXPERTS.fullmatch(name):
            types |= {f'{match[1]}.{expert}.{match[2]}': ggml_type for expert in range(experts)}
    return quantization | {'ggml_types': types}


# Falcon-H1's µP multipliers, each 1: the converter folds them into the tensors (``FalconH1Model.modify_tensors``)
FALCON_H1_FOLDED = {'embedding_multiplier': 1.0, 'lm_head_multiplier': 1.0, 'key_multiplier': 1.0,
                    'attention_in_multiplier': 1.0, 'attention_out_multiplier': 1.0, 'ssm_in_multiplier': 1.0,
                    'ssm_out_multiplier': 1.0, 'ssm_multipliers': [1.0] * 5, 'mlp_multipliers': [1.0, 1.0]}


# the key of TII's pre-release converter, which kept the multipliers as keys (``{arch}.mlp_gate_multiplier``, ...)
FALCON_H1_MUP_KEY = '{arch}.ssm.has_mup'


def falcon_h1_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1: attention (``key_length`` wide heads, rotary over all of them) and a Mamba-2 mixer in every layer;
    the µP multipliers all 1 (:data:`FALCON_H1_FOLDED`: the file's tensors hold them, the embeddings and LM head
    too; a file that names them among its keys, from TII's pre-release converter, is refused); the gated norm where
    the file has ``ssm_norm`` (llama.cpp gates, then norms), else the gate alone; no clamp of the time steps
    (llama.cpp has none); biases as the tensors have them."""
    if meta(FALCON_H1_MUP_KEY) is not None:
        raise ValueError(f'a falcon-h1 file with µP multipliers among its keys '
                         f'({FALCON_H1_MUP_KEY.format(arch="falcon-h1")}: written by a '
                         f'pre-release converter) is not supported: convert the checkpoint again with a current '
                         f'llama.cpp, which folds them into the tensors')
    layers = config['num_hidden_layers']
    mamba = _mamba2(meta, tensors, layers)
    return {'model_type': 'falcon_h1', 'hidden_act': 'silu', **FALCON_H1_FOLDED,
            'rope_parameters': {'rope_type': 'default', 'rope_theta': config['rope_theta']},
            'attention_bias': _has(tensors, 0, 'attn_q', 'bias'), 'mlp_bias': _has(tensors, 0, 'ffn_up', 'bias'),
            'projectors_bias': _has(tensors, 0, 'ssm_out', 'bias'),
            'mamba_d_ssm': mamba['heads'] * mamba['head_dim'], 'mamba_n_heads': mamba['heads'],
            'mamba_d_head': mamba['head_dim'], 'mamba_n_groups': mamba['groups'], 'mamba_d_state': mamba['state'],
            'mamba_d_conv': mamba['kernel'], 'mamba_conv_bias': mamba['conv_bias'],
            'mamba_proj_bias': mamba['proj_bias'], 'mamba_rms_norm': _has(tensors, 0, 'ssm_norm'),
            'mamba_norm_before_gate': False, 'time_step_limit': None}


CONFIG_BUILDERS = {'granitehybrid': granite_hybrid_config, 'nemotron_h': nemotron_h_config,
                   'nemotron_h_moe': nemotron_h_config, 'falcon-h1': falcon_h1_config}


def _mamba2_tensors(state_dict: dict[str, torch.Tensor]) -> None:
    """``A_log``, ``D``, the convolution and the gated norm as the checkpoints hold them."""
    for name, value in state_dict.items():
        if name.endswith('.A_log'):
            state_dict[name] = torch.log(-value.flatten())
        elif name.endswith(('.D', '.norm.weight')) and value.dim() == 2:
            state_dict[name] = value.flatten()
        elif name.endswith('.conv1d.weight'):
            state_dict[name] = value.unsqueeze(1)


def _rename(state_dict: dict[str, torch.Tensor], old: str, new: str) -> None:
    for name in [name for name in state_dict if old in name]:
        state_dict[name.replace(old, new)] = state_dict.pop(name)


def _granite_checkpoint(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Granite's checkpoint: the experts' gate and up back into ``block_sparse_moe.input_linear [E, 2I, H]``, the
    shared MLP's into ``shared_mlp.input_linear [2I, H]``, the router and the down projections under their names."""
    for prefix in [name.removesuffix('mlp.experts.gate_proj.weight') for name in state_dict
                   if name.endswith('mlp.experts.gate_proj.weight')]:
        gate, up = (state_dict.pop(f'{prefix}mlp.experts.{proj}_proj.weight') for proj in ('gate', 'up'))
        state_dict[prefix + 'block_sparse_moe.input_linear.weight'] = torch.cat((gate, up), 1)
    for prefix in [name.removesuffix('shared_mlp.gate_proj.weight') for name in state_dict
                   if name.endswith('shared_mlp.gate_proj.weight')]:
        gate, up = (state_dict.pop(f'{prefix}shared_mlp.{proj}_proj.weight') for proj in ('gate', 'up'))
        state_dict[prefix + 'shared_mlp.input_linear.weight'] = torch.cat((gate, up))
    for old, new in (('.mlp.experts.down_proj.', '.block_sparse_moe.output_linear.'),
                     ('.mlp.gate.', '.block_sparse_moe.router.layer.'),
                     ('.shared_mlp.down_proj.', '.shared_mlp.output_linear.')):
        _rename(state_dict, old, new)


def _split_experts(state_dict: dict[str, torch.Tensor], owner: str) -> None:
    """The stacked experts of ``owner`` (``mlp``, ``mixer``: ``...experts.up_proj.weight [E, ...]`` or its blocks)
    one tensor per expert."""
    stacked = re.compile(rf'(.*\.{owner}\.experts)\.(\w+_proj\.q?weight)')
    for name in [name for name in state_dict if stacked.fullmatch(name)]:
        prefix, tail = stacked.fullmatch(name).groups()
        for expert, part in enumerate(state_dict.pop(name)):
            state_dict[f'{prefix}.{expert}.{tail}'] = part.clone()


def finish_granite_hybrid(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Undo the converter's steps (see the module's docstring) on one group of converted tensors: the checkpoint's
    layout (Granite 4.0-H's, or Bamba's names), or the engine's names where the folder keeps layers as blocks."""
    _mamba2_tensors(state_dict)
    if 'quantization_config' in config:
        _split_experts(state_dict, 'mlp')
    elif config['model_type'] == 'bamba':
        for old, new in (('.shared_mlp.', '.feed_forward.'), ('.post_attention_layernorm.', '.pre_ff_layernorm.'),
                         ('model.norm.', 'model.final_layernorm.')):
            _rename(state_dict, old, new)
    else:
        _granite_checkpoint(state_dict, config)


def finish_nemotron_h(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Undo the converter's steps: the Mamba-2 tensors, the experts one per expert, ``backbone.`` names."""
    _mamba2_tensors(state_dict)
    _split_experts(state_dict, 'mixer')
    for old, new in (('model.embed_tokens.', 'backbone.embeddings.'), ('model.norm.', 'backbone.norm_f.'),
                     ('model.layers.', 'backbone.layers.')):
        _rename(state_dict, old, new)


def finish_falcon_h1(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Undo the converter's steps: the Mamba-2 tensors; where no layer is kept as blocks, the MLP, its norm and the
    final norm under the checkpoint's names (``feed_forward``, ``pre_ff_layernorm``, ``final_layernorm``)."""
    _mamba2_tensors(state_dict)
    if 'quantization_config' in config:
        return
    for old, new in (('.mlp.', '.feed_forward.'), ('.post_attention_layernorm.', '.pre_ff_layernorm.'),
                     ('model.norm.', 'model.final_layernorm.')):
        _rename(state_dict, old, new)


FINISHERS = {'granitehybrid': finish_granite_hybrid, 'nemotron_h': finish_nemotron_h,
             'nemotron_h_moe': finish_nemotron_h, 'falcon-h1': finish_falcon_h1}
