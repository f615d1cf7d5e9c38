"""Gemma 2 and Gemma 3 (text): Llama-shaped layers with local (sliding-window) and global attention
layers (``layer_types``), the Gemma norm (``1 + weight``) before and after attention and MLP, embeddings
scaled by ``sqrt(hidden_size)`` in the model dtype, a GeLU(tanh) MLP and queries scaled by
``query_pre_attn_scalar ** -0.5``. Gemma 2 soft-caps attention scores and final logits; Gemma 3 norms
queries and keys and turns the local layers by their own rope base (``rope_parameters`` per layer type).
The native decoder stack does not run them (their norms and attention features)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, layer_window
from lmdeploy.pytorch.nn.norm import GemmaRMSNorm
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding
from lmdeploy.pytorch.step_context import StepContext

LAYER_TYPES = ('full_attention', 'sliding_attention')


class GemmaAttention(LlamaAttention):
    """Llama attention with Gemma's query scale, the layer's window, score soft-capping (Gemma 2) and
    Gemma-norm q/k norms (Gemma 3)."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        hf = cfg.hf_config
        super().__init__(cfg, scale=hf.query_pre_attn_scalar**-0.5, sliding_window=layer_window(hf, layer_index),
                         logit_softcap=getattr(hf, 'attn_logit_softcapping', None))
        if hf.model_type == 'gemma3_text':
            self.qk_norm = True
            self.q_norm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """``x + post_attention_norm(attn(input_norm(x)))``, then ``+ post_feedforward_norm(mlp(pre_feedforward_norm))``;
    like Llama's layers it hands the residual sum on to the next layer's first norm."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        activation = getattr(hf, 'hidden_activation', None) or hf.hidden_act
        if activation != 'gelu_pytorch_tanh':
            raise ValueError(f'Gemma with activation {activation!r} is not supported')
        self.layer_type = hf.layer_types[layer_index]
        self.self_attn = GemmaAttention(cfg, layer_index)
        self.mlp = LlamaMLP(cfg, activation='gelu_tanh')
        eps = hf.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, kv_cache, ctx))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual

    def native_weights(self, small_step: bool = False) -> None:
        """The native decoder stack has no Gemma layers."""
        return None


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``)."""

    def __init__(self, cfg: ModelConfig):
        hf = cfg.hf_config
        if getattr(hf, 'use_bidirectional_attention', False):
            raise ValueError('Gemma with bidirectional attention (an embedding model) is not supported')
        super().__init__(cfg)
        self.norm = GemmaRMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        per_type = set(LAYER_TYPES) <= set(hf.rope_parameters)
        self.ropes = {kind: RotaryEmbedding(hf, cfg.head_dim, kind) if per_type else self.rotary
                      for kind in LAYER_TYPES}
        self.rotary = self.ropes['full_attention']
        self.final_logit_softcap = getattr(hf, 'final_logit_softcapping', None)
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=cfg.dtype).item()

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, layer_index)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        tables = {kind: rope(ctx, self.cfg.dtype) for kind, rope in self.ropes.items()}
        x = self.embed(input_ids, ctx)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            ctx.cos, ctx.sin = tables[layer.layer_type]
            x, residual = layer(x, residual, kv_cache, ctx)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is None or not self.final_logit_softcap:
            return logits
        return torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
