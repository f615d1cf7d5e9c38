"""Granite 3.x (``GraniteForCausalLM``): Llama layers scaled by four config fields: embeddings times
``embedding_multiplier``, attention scores by ``attention_multiplier`` (in place of ``head_dim ** -0.5``), the
attention and MLP outputs times ``residual_multiplier`` before the residual adds them, and logits divided by
``logits_scaling``. Its layers run in the native decoder stack (``residual_scale``)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, layer_window
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights
from lmdeploy.pytorch.step_context import StepContext


class GraniteDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose attention and MLP outputs are scaled by ``residual_multiplier``."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, attn: LlamaAttention):
        super().__init__(cfg, mlp, attn)
        self.residual_multiplier = cfg.hf_config.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        x, residual = self.norm_input(x, residual)
        x = self.self_attn(x, kv_cache, ctx) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """See :meth:`LlamaDecoderLayer.native_weights`; the stack scales the two outputs too."""
        return self.stack_weights(small_step, residual_scale=float(self.residual_multiplier))


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x's decoder, LM head and multipliers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        self.embedding_multiplier = hf.embedding_multiplier
        self.logits_scaling = hf.logits_scaling

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        attn = LlamaAttention(cfg, scale=hf.attention_multiplier, sliding_window=layer_window(hf, layer_index))
        return GraniteDecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits / self.logits_scaling
