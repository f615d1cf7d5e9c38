"""Phi-3.5-MoE and Phi-tiny-MoE (``PhimoeForCausalLM``): Mixtral's layers with LayerNorms (weight and bias) in
place of RMSNorms, q/k/v/o biases per ``attention_bias``, an LM head bias per ``lm_head_bias``, LongRoPE whose cos
and sin are scaled by ``short_mscale`` or ``long_mscale`` (``nn/rotary.py``) and every layer's experts chosen by
sparsemixer's top-2 (:func:`sparsemixer_top2`). The layers do not run in the native decoder stack (its norms carry
no bias and its MoE blocks have no sparsemixer routing)."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, WeightTarget, layer_window
from lmdeploy.pytorch.models.moe import MoEForCausalLM, SparseMoeBlock
from lmdeploy.pytorch.nn.norm import LayerNorm


def sparsemixer_top2(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, 2] fp32, ids [T, 2])`` of sparsemixer's routing at inference: the best expert, weighted by
    its softmax over the experts whose score is within ``2 * jitter_eps`` (relative) of the best, then the best of
    the others, weighted by its softmax over those within the same distance of it (the first expert left out)."""
    scores = logits.float()
    weights, ids = [], []
    for _ in range(2):
        best, best_id = scores.max(dim=-1, keepdim=True)
        far = (best - logits.float()) / logits.float().abs().clamp(min=best) > 2 * jitter_eps
        weights.append(torch.softmax(scores.masked_fill(far, float('-inf')), dim=-1).gather(-1, best_id))
        ids.append(best_id)
        scores = scores.scatter(-1, best_id, float('-inf'))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


class PhimoeSparseMoeBlock(SparseMoeBlock):
    """Mixtral's block (router ``gate``, experts ``w1``/``w2``/``w3``) routed by :func:`sparsemixer_top2`."""

    def __init__(self, cfg: ModelConfig):
        hf = cfg.hf_config
        if hf.num_experts_per_tok != 2:
            raise ValueError(f'PhiMoE routes by sparsemixer, which picks 2 experts; the config asks for '
                             f'num_experts_per_tok={hf.num_experts_per_tok}')
        super().__init__(cfg)
        self.jitter_eps = hf.router_jitter_noise

    def native_moe(self, small_step: bool = False) -> None:
        """None: the native decoder stack's MoE blocks have no sparsemixer routing."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sparsemixer_top2(self.gate(x), self.jitter_eps)
        return self.experts(x, weights, ids)


class PhimoeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer (its forward) whose norms are LayerNorms with a bias."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        hf = cfg.hf_config
        attn = LlamaAttention(cfg, sliding_window=layer_window(hf, layer_index))
        super().__init__(cfg, PhimoeSparseMoeBlock(cfg), attn)
        self.input_layernorm = LayerNorm(cfg.hidden_size, hf.rms_norm_eps, bias=True)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, hf.rms_norm_eps, bias=True)


class PhimoeForCausalLM(MoEForCausalLM):
    """PhiMoE's decoder, final biased LayerNorm and LM head (with its bias where ``lm_head_bias`` says)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        has_bias = bool(getattr(cfg.hf_config, 'lm_head_bias', False))
        self.lm_head_bias = nn.Parameter(torch.zeros(cfg.vocab_size), requires_grad=False) if has_bias else None

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return PhimoeDecoderLayer(cfg, layer_index)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.hf_config.rms_norm_eps, bias=True)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().logits(hidden)
        if logits is None or self.lm_head_bias is None:
            return logits
        return logits + self.lm_head_bias.to(logits.dtype)

    def weight_target(self, name: str) -> WeightTarget | None:
        if name == 'lm_head.bias':
            return (None if self.lm_head_bias is None else (self.lm_head_bias, 'lm_head_bias', None))
        return super().weight_target(name)
