"""Arcee (``ArceeForCausalLM``, AFM-4.5B): Llama layers whose MLP has no gate, ``down(relu(up(x)) ** 2)``. Its layers
run in the native decoder stack (``ungated_mlp`` ``relu2``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import LlamaForCausalLM
from lmdeploy.pytorch.nn.linear import ColumnLinear, Linear, RowLinear


class ReluSquared(nn.Module):
    """``relu(x) ** 2`` (transformers' ``relu2``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()

    def stack_options(self) -> dict[str, Any]:
        """This activation as the native decoder stack's options (``ungated_mlp``)."""
        return dict(ungated_mlp='relu2')


class UngatedMLP(nn.Module):
    """``down_proj(act_fn(up_proj(x)))``; each tensor-parallel rank holds a share of the intermediate features."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act_fn: nn.Module):
        super().__init__()
        self.up_proj = ColumnLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowLinear.after(self.up_proj, hidden_size, bias=bias)
        self.act_fn = act_fn

    @classmethod
    def of(cls, cfg: ModelConfig, act_fn: nn.Module) -> UngatedMLP:
        """A decoder layer's MLP: ``intermediate_size`` features, biased per ``mlp_bias``."""
        hf = cfg.hf_config
        return cls(cfg.hidden_size, hf.intermediate_size, bool(getattr(hf, 'mlp_bias', False)), act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))

    def stack_parts(self) -> tuple[dict[str, Linear], dict[str, Any]] | None:
        """This MLP's part of a layer's weights in the native decoder stack (``LlamaDecoderLayer.mlp_weights``): its
        up projection as the stack's ``gate_up``, its down projection, and its activation's options; None for an
        activation the stack lacks."""
        if not hasattr(self.act_fn, 'stack_options'):
            return None
        return dict(gate_up=self.up_proj, down=self.down_proj), self.act_fn.stack_options()


class UngatedMLPForCausalLM(LlamaForCausalLM):
    """A Llama decoder whose checkpoints hold an ``up_proj`` without a ``gate_proj`` (nothing to stack it with)."""

    stacked_params = {name: merged for name, merged in LlamaForCausalLM.stacked_params.items()
                      if merged[0] == 'qkv_proj'}


class ArceeForCausalLM(UngatedMLPForCausalLM):
    """Arcee's decoder: Llama's with the ungated ReLU² MLP."""

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        if cfg.hf_config.hidden_act != 'relu2':
            raise ValueError(f'Arcee with activation {cfg.hf_config.hidden_act!r} is not supported, only relu2')
        return UngatedMLP.of(cfg, ReluSquared())
