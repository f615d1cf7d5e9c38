"""Arcee Trinity (``AfmoeForCausalLM``): local layers (sliding-window attention with rotary) and global ones (full
attention without it) per ``layer_types``; q/k RMSNorms per head; the attention output gated per feature by
``sigmoid(gate_proj(x))`` before ``o_proj``; RMSNorms before and after both attention and the MLP; embeddings times
``sqrt(hidden_size)`` where ``mup_enabled``; the first ``num_dense_layers`` layers with Llama's MLP, the others
DeepSeek-V3's MoE in one group (sigmoid top-k over the scores plus ``expert_bias``, renormalized, times
``route_scale``, plus ungated shared experts). Its layers do not run in the native decoder stack (no gate of a
projection of its own on the attention output, no norms after the MLP there)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3MoE
from lmdeploy.pytorch.models.gemma import SLIDING_ATTENTION
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaMLP, WeightTarget, layer_window
from lmdeploy.pytorch.models.moe import MoEForCausalLM
from lmdeploy.pytorch.nn.linear import ColumnLinear
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.rotary import apply_rope
from lmdeploy.pytorch.step_context import StepContext

# checkpoint name fragment -> the engine's: the router and its bias as DeepSeek-V3's, attention's gate apart from the
# MLPs' ``gate_proj``s
CHECKPOINT_NAMES = {'.mlp.router.gate.': '.mlp.gate.', '.mlp.expert_bias': '.mlp.gate.e_score_correction_bias',
                    '.self_attn.gate_proj.': '.self_attn.output_gate.'}


class AfmoeAttention(LlamaAttention):
    """Llama attention (per-head q/k norms; rotary on local layers only) whose output, before ``o_proj``, is gated by
    ``sigmoid(gate_proj(x))`` (the checkpoint's ``gate_proj``, here ``output_gate``), which splits over tensor-parallel
    ranks with the heads."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        hf = cfg.hf_config
        super().__init__(cfg, use_rope=hf.layer_types[layer_index] == SLIDING_ATTENTION,
                         sliding_window=layer_window(hf, layer_index), qk_norm=True)
        self.output_gate = ColumnLinear(cfg.hidden_size, cfg.num_heads * self.head_dim)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        num_qk = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, num_qk + self.num_kv_heads, self.head_dim)
        qk = torch.cat((self.q_norm(qkv[:, :self.num_heads]), self.k_norm(qkv[:, self.num_heads:num_qk])), dim=1)
        if self.use_rope:
            qk = apply_rope(qk, ctx.cos, ctx.sin)
        out = self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, num_qk:], kv_cache, ctx)
        return self.o_proj(out * torch.sigmoid(self.output_gate(x)))


class AfmoeDecoderLayer(nn.Module):
    """``h = x + post_attention_layernorm(attn(input_layernorm(x)))``, then
    ``h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))``; like Llama's layers it hands its last output and the
    residual stream on unadded."""

    def __init__(self, cfg: ModelConfig, layer_index: int, mlp: nn.Module):
        super().__init__()
        eps = cfg.hf_config.rms_norm_eps
        self.self_attn = AfmoeAttention(cfg, layer_index)
        self.mlp = mlp
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps), RMSNorm(cfg.hidden_size, eps)
        self.pre_mlp_layernorm, self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, eps), RMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, kv_cache, ctx))
        x, residual = self.pre_mlp_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual

    def native_weights(self, small_step: bool = False) -> None:
        """None: the native decoder stack has no gate of a projection of its own on the attention output."""
        return None


class AfmoeForCausalLM(MoEForCausalLM):
    """Trinity's decoder; the checkpoints' ``mlp.router.gate`` and ``mlp.expert_bias`` load as DeepSeek-V3's router
    and its correction bias (:data:`CHECKPOINT_NAMES`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embedding_scale = cfg.hidden_size**0.5 if cfg.hf_config.mup_enabled else None

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return AfmoeDecoderLayer(cfg, layer_index, self.make_mlp(cfg, layer_index))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaMLP(cfg) if layer_index < cfg.hf_config.num_dense_layers else DeepseekV3MoE(cfg)

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embedding_scale is None else x * self.embedding_scale

    def weight_target(self, name: str) -> WeightTarget | None:
        for checkpoint_name, engine_name in CHECKPOINT_NAMES.items():
            name = name.replace(checkpoint_name, engine_name)
        return super().weight_target(name)
