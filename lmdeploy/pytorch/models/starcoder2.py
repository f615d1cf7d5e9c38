"""StarCoder2 (``Starcoder2ForCausalLM``: the 3B, 7B and 15B code models): Llama's pre-norm layers with LayerNorms
(weight and bias) in place of RMSNorms, biases on every projection (``use_bias``), an ungated MLP
``c_proj(act(c_fc(x)))`` (GELU-tanh in the hub's configs) and, where the config sets ``sliding_window``, every layer
attending over that window. With GELU-tanh its layers run in the native decoder stack (``layer_norm`` with the norms'
biases, ``ungated_mlp`` ``gelu_tanh``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.arcee import UngatedMLP, UngatedMLPForCausalLM
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, WeightTarget, layer_window
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights
from lmdeploy.pytorch.nn.norm import LayerNorm

# checkpoint name fragment -> the engine's (the MLP's projections)
MLP_NAMES = {'.mlp.c_fc.': '.mlp.up_proj.', '.mlp.c_proj.': '.mlp.down_proj.'}


class GeluTanh(nn.Module):
    """GELU's tanh approximation (transformers' ``gelu_pytorch_tanh``, the hub's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate='tanh')

    def stack_options(self) -> dict[str, Any]:
        """This activation as the native decoder stack's options (``ungated_mlp``)."""
        return dict(ungated_mlp='gelu_tanh')


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """A Llama layer (its forward) of biased projections, an :class:`UngatedMLP` and biased LayerNorms."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        nn.Module.__init__(self)  # LlamaDecoderLayer's makes RMSNorms of rms_norm_eps, which StarCoder2 lacks
        hf = cfg.hf_config
        bias = bool(hf.use_bias)
        self.self_attn = LlamaAttention(cfg, qkv_bias=bias, o_bias=bias, sliding_window=layer_window(hf, layer_index))
        act_fn = GeluTanh() if hf.hidden_act == 'gelu_pytorch_tanh' else ACT2FN[hf.hidden_act]
        self.mlp = UngatedMLP(cfg.hidden_size, hf.intermediate_size, bias, act_fn)
        self.input_layernorm = LayerNorm(cfg.hidden_size, hf.norm_epsilon, bias=True)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, hf.norm_epsilon, bias=True)

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """This layer's weights for the native decoder stack (see ``LlamaDecoderLayer.native_weights``): LayerNorms
        with their biases; None for an activation the stack lacks."""
        return self.stack_weights(small_step, layer_norm=True, input_norm_bias=self.input_layernorm.bias,
                                  post_norm_bias=self.post_attention_layernorm.bias)


class Starcoder2ForCausalLM(UngatedMLPForCausalLM):
    """StarCoder2's decoder and final biased LayerNorm; the checkpoints' ``c_fc``/``c_proj`` load as the ungated
    MLP's ``up_proj``/``down_proj``."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return Starcoder2DecoderLayer(cfg, layer_index)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.hf_config.norm_epsilon, bias=True)

    def weight_target(self, name: str) -> WeightTarget | None:
        for checkpoint_name, engine_name in MLP_NAMES.items():
            name = name.replace(checkpoint_name, engine_name)
        return super().weight_target(name)
