"""Cohere2 (``Cohere2ForCausalLM``: Command R7B, Command A): parallel blocks, where attention and the MLP both read
one weight-only LayerNorm of the layer's input and the residual adds their two outputs; sliding-window layers per
``layer_types`` (3 of every 4) turning queries and keys over neighbouring pairs of each head, the full-attention
layers without rotary (NoPE); the logits multiplied by ``logit_scale``. Its layers run in the native decoder stack
(``parallel_block``, ``layer_norm``)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.gemma import SLIDING_ATTENTION
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, layer_window
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights, layer_weights
from lmdeploy.pytorch.nn.norm import LayerNorm
from lmdeploy.pytorch.step_context import StepContext


class Cohere2DecoderLayer(nn.Module):
    """``h = input_layernorm(x)``, then ``x + attn(h) + mlp(h)``; like Llama's layers it hands its output and the
    residual stream on unadded (the next layer's norm, or the final one, adds them)."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        sliding = hf.layer_types[layer_index] == SLIDING_ATTENTION
        self.self_attn = LlamaAttention(cfg, use_rope=sliding, interleaved_rope=True,
                                        sliding_window=layer_window(hf, layer_index))
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, hf.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        return self.self_attn(h, kv_cache, ctx) + self.mlp(h), residual

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """This layer's weights for the native decoder stack (see ``LlamaDecoderLayer.native_weights``): a
        ``parallel_block`` whose input norm is a ``layer_norm``, no rotary in its NoPE layers."""
        attn, mlp = self.self_attn, self.mlp
        return layer_weights(self.input_layernorm.weight, None, dict(qkv=attn.qkv_proj, o=attn.o_proj,
                                                                     gate_up=mlp.gate_up_proj, down=mlp.down_proj),
                             small_step, parallel_block=True, layer_norm=True,
                             rotary_dim=attn.rotary_dim if attn.use_rope else 0, interleaved_rope=True,
                             sliding_window=attn.attn.sliding_window)


class Cohere2ForCausalLM(LlamaForCausalLM):
    """Cohere2's decoder, final LayerNorm and scaled logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.logit_scale = cfg.hf_config.logit_scale

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return Cohere2DecoderLayer(cfg, layer_index)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.hf_config.layer_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits * self.logit_scale
