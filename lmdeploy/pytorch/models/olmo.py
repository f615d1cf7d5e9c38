"""OLMo 2 (``Olmo2ForCausalLM``) and OLMo 3 (``Olmo3ForCausalLM``): Llama attention and MLP without norms on
their inputs, each output normed before the residual adds it (``post_attention_layernorm``,
``post_feedforward_layernorm``), queries and keys RMS-normed over the whole projection (all heads together)
before the rotary. OLMo 3 adds sliding-window layers (``layer_types``) with a rope of their own
(``rope_parameters`` per layer type). The native decoder stack has no layer without input norm, nor q/k norms
across heads: OLMo's layers run their own forward."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.gemma import rope_per_layer_type
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, layer_window
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding, apply_rope
from lmdeploy.pytorch.step_context import StepContext

FULL_ATTENTION = 'full_attention'


class OlmoAttention(LlamaAttention):
    """Llama attention whose queries and keys are RMS-normed over all their heads together."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        hf = cfg.hf_config
        super().__init__(cfg, sliding_window=layer_window(hf, layer_index))
        if self.num_heads != cfg.num_heads:
            raise ValueError('OLMo 2/3 with tensor parallelism is not supported: its q/k norms span every head')
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, hf.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, hf.rms_norm_eps)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)
        q = apply_rope(self.q_norm(q).view(-1, self.num_heads, self.head_dim), ctx.cos, ctx.sin)
        k = apply_rope(self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim), ctx.cos, ctx.sin)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, ctx))


class OlmoDecoderLayer(nn.Module):
    """``h = x + post_attention_layernorm(attn(x))``, then ``h + post_feedforward_layernorm(mlp(h))``; like
    Llama's layers it hands its last output and the residual stream on unadded (the next layer, or the final
    norm, adds them)."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        self.layer_type = hf.layer_types[layer_index] if getattr(hf, 'layer_types', None) else FULL_ATTENTION
        self.self_attn = OlmoAttention(cfg, layer_index)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        residual = x if residual is None else x + residual
        residual = residual + self.post_attention_layernorm(self.self_attn(residual, kv_cache, ctx))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual

    def native_weights(self, small_step: bool = False) -> None:
        """None: the native decoder stack cannot run this layer (see the module docstring)."""
        return None


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo 2 and OLMo 3; OLMo 3's layers turn by their layer type's rope."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        kinds = {layer.layer_type for layer in self.layers}
        self.ropes = ({kind: RotaryEmbedding(hf, cfg.head_dim, kind) for kind in kinds} if rope_per_layer_type(hf)
                      else {kind: self.rotary for kind in kinds})

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return OlmoDecoderLayer(cfg, layer_index)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        tables = {kind: rope(ctx, self.cfg.dtype) for kind, rope in self.ropes.items()}
        x, residual = self.embed(input_ids, ctx), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            ctx.cos, ctx.sin = tables[layer.layer_type]
            x, residual = layer(x, residual, kv_cache, ctx)
        x, _ = self.norm(x, residual)
        return x
