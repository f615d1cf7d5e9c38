"""Apertus (``ApertusForCausalLM``, Apertus 8B and 70B): Llama layers with q/k RMSNorms per head, norms named
``attention_layernorm`` and ``feedforward_layernorm``, and an ungated MLP whose activation is xIELU with each layer's
learned ``alpha_p``, ``alpha_n`` (and its ``beta``, ``eps``). Its layers run in the native decoder stack
(``ungated_mlp`` ``xielu``)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.arcee import UngatedMLP, UngatedMLPForCausalLM
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, WeightTarget, layer_window
from lmdeploy.pytorch.nn.quant import Layout, new_parameter

# the checkpoint's norm names -> the engine's
NORM_NAMES = {'.attention_layernorm.': '.input_layernorm.', '.feedforward_layernorm.': '.post_attention_layernorm.'}


class XIELU(nn.Module):
    """xIELU: ``alpha_p * x**2 + beta * x`` for ``x > 0``, else ``(expm1(min(x, eps)) - x) * alpha_n + beta * x``, with
    ``alpha_p = softplus(alpha_p')`` and ``alpha_n = beta + softplus(alpha_n')`` of the checkpoint's parameters."""

    def __init__(self):
        super().__init__()
        self.alpha_p = new_parameter((1,), Layout(None, None))
        self.alpha_n = new_parameter((1,), Layout(None, None))
        self.beta = new_parameter((), Layout(None, None))
        self.eps = new_parameter((), Layout(None, None))

    def coefficients(self) -> list[torch.Tensor]:
        """``[alpha_p, alpha_n, beta, eps]`` as the activation uses them (``alpha_p`` and ``alpha_n`` through their
        softplus)."""
        return [F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n), self.beta, self.eps]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p, alpha_n, beta, eps = self.coefficients()
        return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + beta * x)

    def stack_options(self) -> dict[str, Any]:
        """This activation as the native decoder stack's options (``ungated_mlp``, its ``xielu`` coefficients)."""
        return dict(ungated_mlp='xielu', xielu=self.coefficients())


class ApertusForCausalLM(UngatedMLPForCausalLM):
    """Apertus's decoder."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        attn = LlamaAttention(cfg, qk_norm=True, sliding_window=layer_window(cfg.hf_config, layer_index))
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        if cfg.hf_config.hidden_act != 'xielu':
            raise ValueError(f'Apertus with activation {cfg.hf_config.hidden_act!r} is not supported, only xielu')
        return UngatedMLP.of(cfg, XIELU())

    def weight_target(self, name: str) -> WeightTarget | None:
        for checkpoint_name, engine_name in NORM_NAMES.items():
            name = name.replace(checkpoint_name, engine_name)
        return super().weight_target(name)
