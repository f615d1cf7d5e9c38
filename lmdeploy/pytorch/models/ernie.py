"""ERNIE 4.5 dense (``Ernie4_5ForCausalLM``): Llama layers whose rotary turns neighbouring pairs of each head's
features (as GLM's does, over the whole head), with one ``use_bias`` for every projection."""
from __future__ import annotations

from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5's decoder; its layers run in the native decoder stack (interleaved rotary)."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        bias = bool(cfg.hf_config.use_bias)
        attn = LlamaAttention(cfg, interleaved_rope=True, qkv_bias=bias, o_bias=bias)
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaMLP(cfg, bias=bool(cfg.hf_config.use_bias))
