"""SmolLM3: Llama layers, every fourth without rotary embedding (NoPE, per ``no_rope_layers``)."""
from __future__ import annotations

from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Layer ``i`` rotates queries and keys only where ``no_rope_layers[i]`` is 1 (the native decoder
    stack follows each layer's ``use_rope``)."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        attn = LlamaAttention(cfg, use_rope=bool(cfg.hf_config.no_rope_layers[layer_index]))
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)
