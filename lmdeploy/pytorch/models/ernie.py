"""ERNIE 4.5 (``Ernie4_5ForCausalLM``) and ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``): Llama layers whose rotary
turns neighbouring pairs of each head's features (as GLM's does, over the whole head), with one ``use_bias``
for every projection. The MoE model's sparse layers (``moe_layer_start_index`` to ``moe_layer_end_index``, every
``moe_layer_interval``-th) route by softmax with a correction bias (:func:`biased_softmax_topk`) and add ungated
shared experts; its checkpoints' multi-token-prediction layers (``mtp_*``) are not used. The layers of both run in
the native decoder stack (the MoE layers as ``MoEBlock``s routed ``biased_softmax``)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import biased_softmax_topk, cpu
from lmdeploy.pytorch.models.deepseek_v3 import TopKRouter
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from lmdeploy.pytorch.models.moe import MoEForCausalLM, native_experts_with_shared
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import Layout, new_parameter


def ernie_layer(cfg: ModelConfig, mlp: nn.Module) -> LlamaDecoderLayer:
    """A decoder layer with ERNIE's attention (interleaved rotary, ``use_bias``) and ``mlp``."""
    bias = bool(cfg.hf_config.use_bias)
    return LlamaDecoderLayer(cfg, mlp, LlamaAttention(cfg, interleaved_rope=True, qkv_bias=bias, o_bias=bias))


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5's decoder; its layers run in the native decoder stack (interleaved rotary)."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return ernie_layer(cfg, self.make_mlp(cfg, layer_index))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaMLP(cfg, bias=bool(cfg.hf_config.use_bias))


class MoeStatics(nn.Module):
    """The router's correction bias, ``e_score_correction_bias [1, E]`` in fp32 as checkpoints hold it."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.e_score_correction_bias = new_parameter((1, num_experts), Layout(None, None), torch.float32)


class Ernie4_5MoE(nn.Module):
    """Routed experts (fp32 router, :func:`biased_softmax_topk`) plus shared experts every token runs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.top_k, self.norm_min = hf.num_experts_per_tok, hf.moe_norm_min
        self.gate = TopKRouter(cfg.hidden_size, hf.num_experts, correction_bias=False)
        self.moe_statics = MoeStatics(hf.num_experts)
        self.experts = FusedExperts(cfg.hidden_size, hf.moe_intermediate_size, hf.num_experts)
        shared = hf.moe_intermediate_size * hf.moe_num_shared_experts
        self.shared_experts = LlamaMLP(cfg, shared, bias=bool(hf.use_bias)) if shared else None

    def native_moe(self, small_step: bool = False) -> object | None:
        """This block as a ``MoEBlock`` of :class:`~lmdeploy.pytorch.nn.decoder_stack.NativeDecoderStack` with
        routing ``biased_softmax`` (its fp32 router an ``fp32`` projection, its shared experts ungated;
        ``small_step``: for steps of at most ``small_step_rows`` tokens, which only the shared experts' projections
        tell apart); None where a part runs on no native kernel."""
        kernels = cpu.native()
        if kernels is None:
            return None
        native = native_experts_with_shared(self.experts, self.shared_experts, small_step)
        router = self.gate.native_projection()
        if native is None or router is None:
            return None
        return kernels.MoEBlock(router=router, top_k=self.top_k,
                                renormalize=True, routing='biased_softmax',
                                correction_bias=self.moe_statics.e_score_correction_bias.view(-1),
                                norm_min=float(self.norm_min), **native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = biased_softmax_topk(self.gate(x),
                                           self.moe_statics.e_score_correction_bias, self.top_k, self.norm_min)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class Ernie4_5_MoeForCausalLM(MoEForCausalLM):
    """ERNIE 4.5 MoE's decoder; its layers run in the native decoder stack."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return ernie_layer(cfg, self.make_mlp(cfg, layer_index))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        sparse = (hf.moe_layer_start_index <= layer_index <= hf.moe_layer_end_index
                  and (layer_index + 1) % hf.moe_layer_interval == 0)
        return Ernie4_5MoE(cfg) if sparse else LlamaMLP(cfg, bias=bool(hf.use_bias))
