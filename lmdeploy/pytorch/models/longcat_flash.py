"""LongCat-Flash (``LongcatFlashForCausalLM``): each of its ``num_layers`` layers holds two sublayers of DeepSeek-V3's
multi-head latent attention (with LongCat's scales of the queries and of the latent) and a dense MLP, and one
shortcut mixture of experts that reads the first sublayer's normed attention output and whose output joins the
residual stream after the second sublayer. The router's softmax scores over the real experts and
``zero_expert_num`` zero-computation experts, plus a correction bias, pick ``moe_topk`` of them, weighted by their
unbiased scores times ``routed_scaling_factor``; a zero expert gives back its input. The engine's KV cache has one
latent cache per attention sublayer (``num_hidden_layers`` = 2 * ``num_layers``)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import biased_softmax_topk
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3Attention, DeepseekV3ForCausalLM, TopKRouter
from lmdeploy.pytorch.models.llama import KVCache, LlamaMLP, WeightTarget
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.step_context import StepContext

# the checkpoint's router tensors -> the engine's (TopKRouter)
ROUTER_NAMES = {'.mlp.router.classifier.weight': '.mlp.gate.weight',
                '.mlp.router.e_score_correction_bias': '.mlp.gate.e_score_correction_bias'}


def check_config(hf_config: PretrainedConfig) -> None:
    """Raises ValueError for the options of LongCat-Flash's config that transformers' model does not run either:
    zero experts other than identities, unscaled latent-attention inputs, a bias on the router's logits."""
    kind = getattr(hf_config, 'zero_expert_type', None) or 'identity'
    if kind != 'identity':
        raise ValueError(f"zero_expert_type {kind!r} is not supported: LongCat-Flash's zero experts are 'identity'")
    for flag in ('mla_scale_q_lora', 'mla_scale_kv_lora'):
        if getattr(hf_config, flag, True) is False:
            raise ValueError(f'{flag}=false is not supported: LongCat-Flash always scales its queries and latents')
    if getattr(hf_config, 'router_bias', False):
        raise ValueError("router_bias=true is not supported: transformers' LongCat-Flash router leaves the bias "
                         'out of its logits and the released checkpoints have none')


class LongcatFlashMoE(nn.Module):
    """The shortcut mixture of experts: an fp32 router over ``n_routed_experts + zero_expert_num`` slots
    (:func:`biased_softmax_topk`, not renormalized, times ``routed_scaling_factor``); the chosen real experts run,
    the zero experts add their weight times the input."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.num_experts, self.num_zero_experts = hf.n_routed_experts, hf.zero_expert_num or 0
        self.top_k, self.scaling = hf.moe_topk, hf.routed_scaling_factor
        self.gate = TopKRouter(cfg.hidden_size, self.num_experts + self.num_zero_experts, correction_bias=True)
        self.experts = FusedExperts(cfg.hidden_size, hf.expert_ffn_hidden_size, self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = biased_softmax_topk(self.gate(x), self.gate.e_score_correction_bias, self.top_k, None)
        weights = weights * self.scaling
        if not self.num_zero_experts:
            return self.experts(x, weights, ids)
        zero = ids >= self.num_experts
        identity = weights.masked_fill(~zero, 0.0).sum(-1, keepdim=True)
        # a zero expert's slot goes to expert 0 with weight 0
        out = self.experts(x, weights.masked_fill(zero, 0.0), ids.masked_fill(zero, 0))
        return out + (x * identity).to(out.dtype)


class LongcatFlashDecoderLayer(nn.Module):
    """Two sublayers of attention then a dense MLP (each with its pre-norms), the shortcut MoE reading the first
    sublayer's normed attention output."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        eps = cfg.hf_config.rms_norm_eps
        self.self_attn = nn.ModuleList(DeepseekV3Attention(cfg, lora_scales=True) for _ in range(2))
        self.mlps = nn.ModuleList(LlamaMLP(cfg, cfg.hf_config.ffn_hidden_size) for _ in range(2))
        self.input_layernorm = nn.ModuleList(RMSNorm(cfg.hidden_size, eps) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(cfg.hidden_size, eps) for _ in range(2))
        self.mlp = LongcatFlashMoE(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_caches: tuple[KVCache, KVCache],
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(the shortcut MoE's output, the residual stream)``: the next layer (or the final norm) adds them, in
        transformers' order."""
        x, residual = (self.input_layernorm[0](x), x) if residual is None else self.input_layernorm[0](x, residual)
        x = self.self_attn[0](x, kv_caches[0], ctx)
        x, residual = self.post_attention_layernorm[0](x, residual)
        shortcut = self.mlp(x)
        x, residual = self.input_layernorm[1](self.mlps[0](x), residual)
        x = self.self_attn[1](x, kv_caches[1], ctx)
        x, residual = self.post_attention_layernorm[1](x, residual)
        return shortcut, residual + self.mlps[1](x)


class LongcatFlashForCausalLM(DeepseekV3ForCausalLM):
    """LongCat-Flash's decoder: ``num_layers`` :class:`LongcatFlashDecoderLayer`, each over two of the engine's
    latent caches; the checkpoint's multi-token-prediction weights (``model.mtp.*``) are not used. Its layers do not
    run in the native decoder stack (it has no shortcut MoE)."""

    def __init__(self, cfg: ModelConfig):
        check_config(cfg.hf_config)
        super().__init__(dataclasses.replace(cfg, num_layers=cfg.hf_config.num_layers))
        self.cfg = cfg

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LongcatFlashDecoderLayer(cfg)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        ctx.cos, ctx.sin = self.rotary(ctx, self.cfg.dtype)
        x, residual = self.embed(input_ids, ctx), None
        for layer, caches in zip(self.layers, zip(kv_caches[0::2], kv_caches[1::2])):
            x, residual = layer(x, residual, caches, ctx)
        x, _ = self.norm(x, residual)
        return x

    def weight_target(self, name: str) -> WeightTarget | None:
        if name.startswith('mtp.'):
            return None
        for old, new in ROUTER_NAMES.items():
            name = name.replace(old, new)
        return super().weight_target(name)

    def finalize_weights(self, pack_cpu: bool, small_step_int4: bool) -> None:
        """Lays out the weights for their kernels as DeepSeek-V3's (:meth:`DeepseekV3ForCausalLM.finalize_layers`),
        without a native decoder stack."""
        self.finalize_layers(pack_cpu, small_step_int4)
