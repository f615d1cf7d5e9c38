"""GLM-4.5, GLM-4.5-Air and GLM-4.6 (``Glm4MoeForCausalLM``): Llama attention (q/k/v biases, optional q/k
RMSNorm, rotary over the first ``partial_rotary_factor`` of each head's features in halves, as Llama does)
with DeepSeek-V3's mixture of experts: sigmoid grouped top-k routing with a correction bias, a shared expert
and dense first layers. The checkpoints' next-token-prediction layers past ``num_hidden_layers`` are not
used."""
from __future__ import annotations

from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3ForCausalLM
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.5's decoder: DeepSeek-V3's layers (:meth:`make_mlp`, the unused prediction layers) with
    :class:`LlamaAttention`; with native GEMM weights its layers run in the native decoder stack, the mixture-of-
    experts layers as ``MoEBlock``s with DeepSeek-V3's routing (``DeepseekV3MoE.native_moe``)."""

    stacked_params = LlamaForCausalLM.stacked_params
    finalize_weights = LlamaForCausalLM.finalize_weights

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), LlamaAttention(cfg, o_bias=False))
