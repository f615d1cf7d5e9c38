"""Mamba and Falcon Mamba (``mamba``) from GGUF: the Mamba-1 decoders of ``models/mamba.py``. What
convert_hf_to_gguf.py's ``MambaModel`` writes, read back here:

- no attention: ``attention.head_count`` and ``feed_forward_length`` 0, a context of 2**20 (arbitrary);
- the mixer's sizes as ``ssm.*`` keys (``time_step_rank`` is dt's rank), Falcon Mamba told apart by
  ``ssm.dt_b_c_rms`` (its weightless norms on dt, B and C; their epsilon is not written: Falcon Mamba's configs' 1e-6);
- ``A_log`` stored as ``ssm_a = -exp(A_log)`` and ``D`` as ``ssm_d``, without a ``.weight``; the convolution
  ``[C, 1, K]`` as ``[C, K]``; the block's norm as ``attn_norm``; the LM head left out where tied.
"""
from __future__ import annotations

from typing import Any

import torch
from gguf import Keys

from .gguf_keys import Meta, required

ARCHITECTURES = {'mamba': 'MambaForCausalLM'}
LAYER_NAMES = {'mamba': {'attn_norm': 'norm', 'ssm_in': 'mixer.in_proj', 'ssm_conv1d': 'mixer.conv1d',
                         'ssm_x': 'mixer.x_proj', 'ssm_dt': 'mixer.dt_proj', 'ssm_out': 'mixer.out_proj'}}
# tensors llama.cpp names without a ``.weight``/``.bias`` kind
UNSUFFIXED_NAMES = {'mamba': {'ssm_a': 'mixer.A_log', 'ssm_d': 'mixer.D'}}
FALCON_MAMBA_MIXER_EPS = 1e-6


def mamba_config(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The Mamba-1 blocks' fields; no attention heads (the file's 0 are not heads)."""
    kernel, inner, state, rank = required(meta, Keys.SSM.CONV_KERNEL, Keys.SSM.INNER_SIZE, Keys.SSM.STATE_SIZE,
                                          Keys.SSM.TIME_STEP_RANK)
    falcon = bool(meta(Keys.SSM.DT_B_C_RMS, False))
    fields = {'model_type': 'falcon_mamba' if falcon else 'mamba',
              'architectures': ['FalconMambaForCausalLM' if falcon else 'MambaForCausalLM'],
              'num_attention_heads': None, 'num_key_value_heads': None, 'head_dim': None,
              'intermediate_size': inner, 'expand': inner // config['hidden_size'], 'state_size': state,
              'conv_kernel': kernel, 'time_step_rank': rank, 'layer_norm_epsilon': config['rms_norm_eps'],
              'use_conv_bias': 'blk.0.ssm_conv1d.bias' in tensors, 'use_bias': 'blk.0.ssm_in.bias' in tensors}
    return fields | ({'mixer_rms_eps': FALCON_MAMBA_MIXER_EPS} if falcon else {})


CONFIG_BUILDERS = {'mamba': mamba_config}


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


FINISHERS = {'mamba': finish_mamba}
