"""OLMo 2 (``Olmo2ForCausalLM``) and OLMo 3 (``Olmo3ForCausalLM``): Llama attention and MLP without norms on
their inputs, each output normed before the residual adds it (``post_attention_layernorm``,
``post_feedforward_layernorm``), queries and keys RMS-normed over the whole projection (all heads together)
before the rotary. OLMo 3 adds sliding-window layers (``layer_types``) with a rope of their own
(``rope_parameters`` per layer type). Their layers run in the native decoder stack (``post_norms_only``,
``qk_norm_across_heads``; OLMo 3's sliding layers on its local rotary table where they have their own rope).

OLMoE (``OlmoeForCausalLM``): Llama's pre-norm layers with OLMo's attention (queries, keys and values clamped to
``clip_qkv`` where the config sets it) and in every layer a mixture of experts routed by softmax, its top-k
renormalized only with ``norm_topk_prob``. Its layers run in the native decoder stack (``qk_norm_across_heads``,
MoE blocks) unless ``clip_qkv`` is set."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.gemma import (FULL_ATTENTION, SLIDING_ATTENTION, LayerTypeRopeForCausalLM,
                                          rope_per_layer_type)
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaMLP, layer_window
from lmdeploy.pytorch.models.moe import MoEForCausalLM
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights, layer_weights
from lmdeploy.pytorch.nn.norm import RMSNorm, norm_across_heads, qk_norms_across_heads
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding, apply_rope
from lmdeploy.pytorch.step_context import StepContext


class OlmoAttention(LlamaAttention):
    """Llama attention whose queries and keys are RMS-normed over all their heads together (under tensor parallelism
    over every rank's heads: ``nn/norm.py``'s :func:`norm_across_heads`); queries, keys and values clamped to
    ``[-clip_qkv, clip_qkv]`` where the config sets it (OLMoE's)."""

    def __init__(self, cfg: ModelConfig, sliding_window: int | None = None):
        super().__init__(cfg, sliding_window=sliding_window, qk_norm=False)
        self.q_norm, self.k_norm = qk_norms_across_heads(self.qkv_proj, cfg.hf_config.rms_norm_eps)
        self.clip_qkv = getattr(cfg.hf_config, 'clip_qkv', None)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)
        q, k = norm_across_heads(self.q_norm, self.k_norm, q, k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), ctx.cos, ctx.sin)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), ctx.cos, ctx.sin)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, ctx))


class OlmoDecoderLayer(nn.Module):
    """``h = x + post_attention_layernorm(attn(x))``, then ``h + post_feedforward_layernorm(mlp(h))``; like
    Llama's layers it hands its last output and the residual stream on unadded (the next layer, or the final
    norm, adds them). ``attn``: OLMo's attention unless given (EXAONE 4's has per-head q/k norms)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, attn: LlamaAttention | None = None):
        super().__init__()
        hf = cfg.hf_config
        self.layer_type = hf.layer_types[layer_index] if getattr(hf, 'layer_types', None) else FULL_ATTENTION
        self.own_rope = rope_per_layer_type(hf)
        self.self_attn = attn or OlmoAttention(cfg, layer_window(hf, layer_index))
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        residual = x if residual is None else x + residual
        residual = residual + self.post_attention_layernorm(self.self_attn(residual, kv_cache, ctx))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """This layer's weights for the native decoder stack (see ``LlamaDecoderLayer.native_weights``): no input
        nor pre-MLP norm (``post_norms_only``), its two post-norms as the stack's norms of the attention and MLP
        outputs, its q/k norms (over all heads for OLMo's attention), OLMo 3's sliding layers turning by the step's local rotary table
        where they have their own rope."""
        attn, mlp = self.self_attn, self.mlp
        return layer_weights(None, None, dict(qkv=attn.qkv_proj, o=attn.o_proj, gate_up=mlp.gate_up_proj,
                                              down=mlp.down_proj),
                             small_step, post_norms_only=True, attn_out_norm=self.post_attention_layernorm.weight,
                             mlp_out_norm=self.post_feedforward_layernorm.weight, q_norm=attn.q_norm.weight,
                             k_norm=attn.k_norm.weight, qk_norm_across_heads=isinstance(attn, OlmoAttention),
                             rotary_dim=attn.rotary_dim if attn.use_rope else 0,
                             sliding_window=attn.attn.sliding_window,
                             local_rope=self.own_rope and self.layer_type == SLIDING_ATTENTION)


class OlmoForCausalLM(LayerTypeRopeForCausalLM):
    """OLMo 2 and OLMo 3; OLMo 3's layers turn by their layer type's rope."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        kinds = {layer.layer_type for layer in self.layers}
        self.ropes = ({kind: RotaryEmbedding(hf, cfg.head_dim, kind) for kind in kinds} if rope_per_layer_type(hf)
                      else {kind: self.rotary for kind in kinds})

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return OlmoDecoderLayer(cfg, layer_index)


class OlmoAttentionDecoderLayer(LlamaDecoderLayer):
    """A Llama layer (norms before attention and MLP) of :class:`OlmoAttention` (q/k norms over all heads):
    OLMoE's and MiniMax-M2's."""

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """See :meth:`LlamaDecoderLayer.native_weights`; None where the attention clamps (the stack does not)."""
        attn = self.self_attn
        if attn.clip_qkv is not None:
            return None
        return self.stack_weights(small_step, q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
                                  qk_norm_across_heads=True)


class OlmoeForCausalLM(MoEForCausalLM):
    """OLMoE's decoder: :class:`OlmoAttentionDecoderLayer`s of OLMo's attention and a softmax-routed MoE block."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return OlmoAttentionDecoderLayer(cfg, self.make_mlp(cfg, layer_index), OlmoAttention(cfg))
