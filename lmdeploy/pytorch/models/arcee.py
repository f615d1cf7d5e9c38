"""Arcee (``ArceeForCausalLM``, AFM-4.5B): Llama layers whose MLP has no gate, ``down(relu(up(x)) ** 2)``. Its layers
do not run in the native decoder stack (whose MLPs are gated)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import LlamaForCausalLM
from lmdeploy.pytorch.nn.linear import ColumnLinear, RowLinear


class ReluSquaredMLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``; each tensor-parallel rank holds a share of the intermediate features."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        if hf.hidden_act != 'relu2':
            raise ValueError(f'Arcee with activation {hf.hidden_act!r} is not supported, only relu2')
        bias = bool(getattr(hf, 'mlp_bias', False))
        self.up_proj = ColumnLinear(cfg.hidden_size, hf.intermediate_size, bias=bias)
        self.down_proj = RowLinear.after(self.up_proj, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class ArceeForCausalLM(LlamaForCausalLM):
    """Arcee's decoder: Llama's with the ungated ReLU² MLP."""

    stacked_params = {name: merged for name, merged in LlamaForCausalLM.stacked_params.items()
                      if merged[0] == 'qkv_proj'}

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return ReluSquaredMLP(cfg)
