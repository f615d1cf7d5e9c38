"""GLM-4.5, GLM-4.5-Air and GLM-4.6 (``Glm4MoeForCausalLM``): Llama attention (q/k/v biases, optional q/k
RMSNorm, rotary over the first ``partial_rotary_factor`` of each head's features in halves, as Llama does)
with DeepSeek-V3's mixture of experts: sigmoid grouped top-k routing with a correction bias, a shared expert
and dense first layers. GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``) has DeepSeek-V3's multi-head latent
attention with the same mixture of experts, its dense layers those ``mlp_layer_types`` marks ``dense``. The
checkpoints' next-token-prediction layers past ``num_hidden_layers`` are not used."""
from __future__ import annotations

from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.5's decoder: DeepSeek-V3's layers (:meth:`make_mlp`, the unused prediction layers) with
    :class:`LlamaAttention`; with native GEMM weights its layers run in the native decoder stack, the mixture-of-
    experts layers as ``MoEBlock``s with DeepSeek-V3's routing (``DeepseekV3MoE.native_moe``)."""

    stacked_params = LlamaForCausalLM.stacked_params
    finalize_weights = LlamaForCausalLM.finalize_weights

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), LlamaAttention(cfg, o_bias=False))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash's decoder: DeepSeek-V3's, with multi-head latent attention over a latent cache (rotary pairs
    interleaved unless ``rope_interleave`` is off) and its layers dense or sparse by ``mlp_layer_types``; every
    layer runs in the native decoder stack as DeepSeek-V3's do."""

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return DeepseekV3MoE(cfg) if cfg.hf_config.mlp_layer_types[layer_index] == 'sparse' else LlamaMLP(cfg)
