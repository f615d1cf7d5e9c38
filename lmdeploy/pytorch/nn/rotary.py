"""Rotary embedding tables; the scaling variants come from transformers' own init functions."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding(nn.Module):
    """Computes per-token ``cos, sin [T, head_dim]`` for the model's rope type.

    With ``mrope_section`` (Qwen-VL) positions are ``[3, T]`` (temporal, height, width) and each
    band of frequencies turns with one of the three.
    """

    def __init__(self, hf_config: PretrainedConfig, head_dim: int):
        super().__init__()
        params = getattr(hf_config, 'rope_parameters', None) or {}
        rope_type = params.get('rope_type', 'default')
        if rope_type == 'default':
            base = params.get('rope_theta', getattr(hf_config, 'rope_theta', 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != 'dynamic':
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device('cpu'))
        else:
            raise ValueError(f'rope type {rope_type!r} is not supported')
        # A plain attribute, not a buffer: casting the model to bf16 must not round the frequencies.
        self.inv_freq = inv_freq
        sections = params.get('mrope_section')
        self.mrope_select = None if sections is None else torch.cat(
            [torch.full((size,), index % 3) for index, size in enumerate(sections)])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:  # moved once, so that a CUDA graph captures no copy
            self.inv_freq = self.inv_freq.to(positions.device)
            self.mrope_select = None if self.mrope_select is None else self.mrope_select.to(positions.device)
        if positions.dim() == 2:
            freqs = positions.float()[self.mrope_select].T * self.inv_freq
        else:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
