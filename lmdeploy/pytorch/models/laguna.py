"""Laguna (``LagunaForCausalLM``, poolside): Llama's pre-norm layers of full and sliding-window attention
(``layer_types``), each type with a rope of its own (base and ``partial_rotary_factor`` per layer type); per-head q/k
RMSNorms; a layer's own number of query heads (``num_attention_heads_per_layer``); the attention output gated by
``softplus(g_proj(x))``, one gate per head (``gating`` true or ``per-head``) or per feature (``per-element``); dense
layers where ``mlp_layer_types`` says ``dense``, the others DeepSeek-V3's mixture of experts in one group (sigmoid
top-k over the scores plus a correction bias, renormalized, times ``moe_routed_scaling_factor``, the router's logits
soft-capped by ``moe_router_logit_softcapping`` where set) plus an ungated shared expert of
``shared_expert_intermediate_size``. Its layers do not run in the native decoder stack (no gate of the attention
output there, and the stack's layers share one number of heads)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3MoE
from lmdeploy.pytorch.models.gemma import LayerTypeRopeForCausalLM
from lmdeploy.pytorch.models.llama import (KVCache, LlamaAttention, LlamaDecoderLayer, LlamaMLP, WeightTarget,
                                           WithoutNativeStack, layer_window)
from lmdeploy.pytorch.models.moe import MoEForCausalLM
from lmdeploy.pytorch.nn.linear import ColumnLinear
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding
from lmdeploy.pytorch.step_context import StepContext

# checkpoint name fragment -> the engine's: the hub's router bias and shared expert (transformers renames them so)
CHECKPOINT_NAMES = {'.mlp.experts.e_score_correction_bias': '.mlp.gate.e_score_correction_bias',
                    '.mlp.shared_expert.': '.mlp.shared_experts.'}


class LagunaAttention(LlamaAttention):
    """Llama attention of the layer's own number of query heads, per-head q/k norms, the layer type's rope and window,
    its output (before ``o_proj``) times ``softplus(g_proj(x))`` per head or per feature; ``g_proj`` splits over
    tensor-parallel ranks with the heads."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        hf = cfg.hf_config
        heads = hf.num_attention_heads_per_layer[layer_index]
        super().__init__(dataclasses.replace(cfg, num_heads=heads), sliding_window=layer_window(hf, layer_index),
                         qk_norm=True)
        self.gate_per_head = hf.gating is True or hf.gating == 'per-head'
        self.g_proj = ColumnLinear(cfg.hidden_size, heads if self.gate_per_head else heads * self.head_dim)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        out = self.attend(x, kv_cache, ctx)
        gate = F.softplus(self.g_proj(x).float()).to(out.dtype)
        if self.gate_per_head:
            out = (out.view(-1, self.num_heads, self.head_dim) * gate.unsqueeze(-1)).flatten(1)
        else:
            out = out * gate
        return self.o_proj(out)


class LagunaMoE(DeepseekV3MoE):
    """DeepSeek-V3's mixture of experts whose router logits are soft-capped (``moe_router_logit_softcapping``, 0: off)
    and whose shared expert, where ``shared_expert_intermediate_size`` is set, is of that size (Laguna's); MiMo-V2-Flash
    has neither."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        self.logit_cap = getattr(hf, 'moe_router_logit_softcapping', 0.0) or None
        shared = getattr(hf, 'shared_expert_intermediate_size', None)
        if shared:
            self.shared_experts = LlamaMLP(cfg, shared)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.logit_cap is not None:
            logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        return super().route(logits)


class LayerTypeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer that knows its layer type (which rope table it turns by)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, mlp: nn.Module, attn: nn.Module):
        super().__init__(cfg, mlp, attn)
        self.layer_type = cfg.hf_config.layer_types[layer_index]


class LagunaForCausalLM(WithoutNativeStack, LayerTypeRopeForCausalLM, MoEForCausalLM):
    """Laguna's decoder: :class:`LagunaAttention` and a dense MLP or :class:`LagunaMoE` per ``mlp_layer_types``, each
    layer turning by its type's rope."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.ropes = {kind: RotaryEmbedding(cfg.hf_config, cfg.head_dim, kind)
                      for kind in set(cfg.hf_config.layer_types)}

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LayerTypeDecoderLayer(cfg, layer_index, self.make_mlp(cfg, layer_index),
                                     LagunaAttention(cfg, layer_index))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LagunaMoE(cfg) if cfg.hf_config.mlp_layer_types[layer_index] == 'sparse' else LlamaMLP(cfg)

    def weight_target(self, name: str) -> WeightTarget | None:
        for checkpoint_name, engine_name in CHECKPOINT_NAMES.items():
            name = name.replace(checkpoint_name, engine_name)
        return super().weight_target(name)
