"""GLM (``GlmForCausalLM``, GLM-4-9B-chat) and GLM-4 (``Glm4ForCausalLM``, GLM-4-0414): Llama layers whose
rotary turns neighbouring pairs of the first half of each head's features, with q/k/v biases and a fused
``gate_up_proj``; GLM-4 also normalizes the outputs of attention and of the MLP."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.step_context import StepContext

# the model types whose layers normalize the outputs of attention and of the MLP: GLM-4-0414 and GLM-4.1V's text model
GLM4_MODEL_TYPES = ('glm4', 'glm4v_text')


class Glm4DecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose attention and MLP outputs are normalized before the residual adds them."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, attn: LlamaAttention):
        super().__init__(cfg, mlp, attn)
        eps = cfg.hf_config.rms_norm_eps
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        x, residual = self.norm_input(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(x, kv_cache, ctx))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """See :meth:`LlamaDecoderLayer.native_weights`; the stack norms the two outputs too."""
        return self.stack_weights(small_step, attn_out_norm=self.post_self_attn_layernorm.weight,
                                  mlp_out_norm=self.post_mlp_layernorm.weight)


class GlmForCausalLM(LlamaForCausalLM):
    """GLM and GLM-4."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        attn = LlamaAttention(cfg, interleaved_rope=True, o_bias=False)
        layer = Glm4DecoderLayer if cfg.hf_config.model_type in GLM4_MODEL_TYPES else LlamaDecoderLayer
        return layer(cfg, self.make_mlp(cfg, layer_index), attn)
