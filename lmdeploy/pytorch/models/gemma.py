"""Gemma 2 and Gemma 3 (text): Llama-shaped layers with local (sliding-window) and global attention
layers (``layer_types``), the Gemma norm (``1 + weight``) before and after attention and MLP, embeddings
scaled by ``sqrt(hidden_size)`` in the model dtype, a GeLU(tanh) MLP and queries scaled by
``query_pre_attn_scalar ** -0.5``. Gemma 2 soft-caps attention scores and final logits; Gemma 3 norms
queries and keys and turns the local layers by their own rope base (``rope_parameters`` per layer type).
The native decoder stack runs their layers (Gemma 3's local ones on its local rotary table)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, layer_window
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights, layer_weights
from lmdeploy.pytorch.nn.norm import GemmaRMSNorm
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding
from lmdeploy.pytorch.step_context import StepContext

FULL_ATTENTION, SLIDING_ATTENTION = 'full_attention', 'sliding_attention'
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def soft_capped(logits: torch.Tensor | None, cap: float | None) -> torch.Tensor | None:
    """``tanh(logits / cap) * cap`` (Gemma's final logit soft-capping); ``logits`` as they are without a cap."""
    if logits is None or not cap:
        return logits
    return torch.tanh(logits / cap) * cap


def rope_per_layer_type(hf_config) -> bool:
    """Whether local and global layers turn by rope tables of their own (Gemma 3)."""
    return set(LAYER_TYPES) <= set(hf_config.rope_parameters)


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
        self.own_rope = rope_per_layer_type(hf)
        self.dtype = cfg.dtype
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

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """This layer's weights for the native decoder stack (see ``LlamaDecoderLayer.native_weights``): its
        post-attention and post-feed-forward norms as the stack's norms of the attention and MLP outputs, its
        pre-feed-forward norm as the stack's post-attention norm, each Gemma norm as the plain weight
        ``1 + w`` it computes, Gemma 3's local layers turning by the step's local rotary table."""
        attn, mlp = self.self_attn, self.mlp
        norms = dict(q_norm=attn.q_norm.scale(self.dtype), k_norm=attn.k_norm.scale(self.dtype)) if attn.qk_norm else {}
        return layer_weights(self.input_layernorm.scale(self.dtype), self.pre_feedforward_layernorm.scale(self.dtype),
                             dict(qkv=attn.qkv_proj, o=attn.o_proj, gate_up=mlp.gate_up_proj, down=mlp.down_proj),
                             attn_out_norm=self.post_attention_layernorm.scale(self.dtype),
                             mlp_out_norm=self.post_feedforward_layernorm.scale(self.dtype), rotary_dim=attn.rotary_dim,
                             sliding_window=attn.attn.sliding_window, logit_softcap=attn.attn.logit_softcap,
                             gelu_tanh_mlp=True, local_rope=self.own_rope and self.layer_type == 'sliding_attention',
                             small_step=small_step, **norms)


class LayerTypeRopeForCausalLM(LlamaForCausalLM):
    """A decoder whose layers turn by their layer type's rotary table (``ropes``: layer type -> rotary embedding);
    in the native decoder stack the full-attention table is the step's and the sliding one the local table."""

    ropes: dict[str, RotaryEmbedding]

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        tables = {kind: rope(ctx, self.cfg.dtype) for kind, rope in self.ropes.items()}
        x = self.embed(input_ids, ctx)
        if self.native_stack is not None and self.native_stack.runs(x.shape[0]):
            ctx.cos, ctx.sin = tables.get(FULL_ATTENTION) or tables[SLIDING_ATTENTION]
            x, residual = self.native_stack(x, kv_caches, ctx, local_rope=tables.get(SLIDING_ATTENTION))
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                ctx.cos, ctx.sin = tables[layer.layer_type]
                x, residual = layer(x, residual, kv_cache, ctx)
        x, _ = self.norm(x, residual)
        return x


class GemmaForCausalLM(LayerTypeRopeForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``)."""

    def __init__(self, cfg: ModelConfig):
        hf = cfg.hf_config
        if getattr(hf, 'use_bidirectional_attention', False):
            raise ValueError('Gemma with bidirectional attention (an embedding model) is not supported')
        super().__init__(cfg)
        self.norm = GemmaRMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        per_type = rope_per_layer_type(hf)
        self.ropes = {kind: RotaryEmbedding(hf, cfg.head_dim, kind) if per_type else self.rotary
                      for kind in LAYER_TYPES}
        self.rotary = self.ropes['full_attention']
        self.final_logit_softcap = getattr(hf, 'final_logit_softcapping', None)
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=cfg.dtype).item()

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, layer_index)

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return soft_capped(self.lm_head(hidden), self.final_logit_softcap)
