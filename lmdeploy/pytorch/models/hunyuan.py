"""Hunyuan-A13B (``HunYuanMoEV1ForCausalLM``) and the dense Hunyuan 0.5B-7B (``HunYuanDenseV1ForCausalLM``): Llama
attention whose queries and keys are RMS-normed per head after the rotary (``query_layernorm``, ``key_layernorm``),
over NTK-alpha rope (``rope_type`` dynamic with an ``alpha``: a fixed base of ``rope_theta * alpha ** (d / (d - 2))``,
whatever the length; ``nn/rotary.py``). Hunyuan-A13B's every layer is a MoE routed by softmax top-k over an fp32
router (``gate.wg``), renormalized, plus an ungated shared MLP; the dense models' MLP is Llama's. Their layers run in
the native decoder stack (``qk_norm_after_rope``; the MoE as a ``MoEBlock`` routed ``softmax`` on its ``fp32``
router)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import cpu, moe_routing
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from lmdeploy.pytorch.models.moe import MoEForCausalLM, native_experts_with_shared
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights
from lmdeploy.pytorch.nn.moe import Fp32Router, FusedExperts
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.rotary import apply_rope
from lmdeploy.pytorch.step_context import StepContext


class HunYuanAttention(LlamaAttention):
    """Llama attention with per-head q/k RMSNorms after the rotary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, qk_norm=False)
        eps = cfg.hf_config.rms_norm_eps
        self.query_layernorm, self.key_layernorm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :self.num_heads + self.num_kv_heads].contiguous(), ctx.cos, ctx.sin)
        q = self.query_layernorm(qk[:, :self.num_heads].contiguous())
        k = self.key_layernorm(qk[:, self.num_heads:].contiguous())
        return self.o_proj(self.attn(q, k, qkv[:, self.num_heads + self.num_kv_heads:], kv_cache, ctx))


class HunYuanMoE(nn.Module):
    """Softmax top-k routing over the fp32 router ``gate.wg``, renormalized; the shared MLP added ungated."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        self.top_k = hf.moe_topk if isinstance(hf.moe_topk, int) else hf.moe_topk[layer_index]
        self.gate = nn.ModuleDict({'wg': Fp32Router(cfg.hidden_size, hf.num_experts)})
        self.experts = FusedExperts(cfg.hidden_size, hf.intermediate_size, hf.num_experts)
        self.shared_mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_routing(self.gate['wg'](x), self.top_k, True)
        return self.experts(x, weights, ids) + self.shared_mlp(x)

    def native_moe(self, small_step: bool = False) -> object | None:
        """This block as a ``MoEBlock`` of the native decoder stack (see ``SparseMoeBlock.native_moe``); None where a
        part runs on no native kernel."""
        native = native_experts_with_shared(self.experts, self.shared_mlp, small_step)
        router = self.gate['wg'].native_projection()
        if native is None or router is None:
            return None
        return cpu.native().MoEBlock(router=router, top_k=self.top_k, renormalize=True, routing='softmax', **native)


class HunYuanDecoderLayer(LlamaDecoderLayer):
    """A Llama layer of :class:`HunYuanAttention` and :class:`HunYuanMoE` (or Llama's MLP: the dense models)."""

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """As ``LlamaDecoderLayer.native_weights``, its q/k norms applied after the rotary."""
        attn = self.self_attn
        return self.stack_weights(small_step, q_norm=attn.query_layernorm.weight, k_norm=attn.key_layernorm.weight,
                                  qk_norm_after_rope=True)


class HunYuanMoEV1ForCausalLM(MoEForCausalLM):
    """Hunyuan-A13B's decoder."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return HunYuanDecoderLayer(cfg, HunYuanMoE(cfg, layer_index), HunYuanAttention(cfg))


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """The dense Hunyuan decoder: :class:`HunYuanAttention` with Llama's MLP."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return HunYuanDecoderLayer(cfg, self.make_mlp(cfg, layer_index), HunYuanAttention(cfg))
