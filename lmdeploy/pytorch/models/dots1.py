"""dots.llm1 (``Dots1ForCausalLM``): Qwen3's attention (q/k RMSNorm per head before the rotary; sliding-window layers
per ``layer_types``) with DeepSeek-V3's mixture of experts: an fp32 router, sigmoid grouped top-k with a correction
bias (``noaux_tc``), ``routed_scaling_factor``, ungated shared experts and ``first_k_dense_replace`` dense layers.
Its layers run in the native decoder stack as GLM-4.5's do."""
from __future__ import annotations

from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.glm4_moe import Glm4MoeForCausalLM
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, layer_window


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    """GLM-4.5's decoder with per-head q/k norms and windows per layer."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        attn = LlamaAttention(cfg, qk_norm=True, sliding_window=layer_window(cfg.hf_config, layer_index))
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)
