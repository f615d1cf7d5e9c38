"""AI21 Jamba (``JambaForCausalLM``: Jamba v0.1, Jamba 1.5/1.6/1.7 Mini and Large): a hybrid decoder of Mamba-1
layers (``models/mamba1.py``, with RMSNorms on dt, B and C; a recurrent state per sequence) and, one in
``attn_layer_period`` layers from ``attn_layer_offset``, attention without positions over the paged KV cache; each
layer's feed-forward is a gated SiLU MLP or, one in ``expert_layer_period`` layers from ``expert_layer_offset``, a
mixture of experts (softmax over all experts, the top-k weights not renormalized). Every step runs the layers' own
forward (no native decoder stack)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import RECURRENT_LAYER_TYPES, ModelConfig
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaMLP, WithoutNativeStack
from lmdeploy.pytorch.models.mamba1 import WEIGHTED_NORMS, Mamba1Mixer, Mamba1Shape
from lmdeploy.pytorch.models.moe import MoEForCausalLM, SparseMoeBlock
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# checkpoint name fragment -> the engine's
RENAMED = {'.feed_forward.router.': '.mlp.gate.', '.feed_forward.': '.mlp.', '.pre_ff_layernorm.':
           '.post_attention_layernorm.', 'model.final_layernorm.': 'model.norm.'}


def jamba_mamba_shape(hf: PretrainedConfig) -> Mamba1Shape:
    """The Mamba-1 layers' shape from Jamba's ``mamba_*`` config fields."""
    return Mamba1Shape(hf.mamba_expand * hf.hidden_size, hf.mamba_d_state, hf.mamba_d_conv, hf.mamba_dt_rank,
                       bool(hf.mamba_conv_bias), bool(hf.mamba_proj_bias), WEIGHTED_NORMS, hf.rms_norm_eps)


class JambaLayer(nn.Module):
    """``x + mixer(norm(x))`` with a :class:`Mamba1Mixer` (``mamba``) or attention without rotary positions
    (``self_attn``), then ``x + mlp(norm(x))``; like Llama's layers it hands the residual sum on."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        self.is_linear = hf.layer_types[layer_index] in RECURRENT_LAYER_TYPES
        if self.is_linear:
            self.mamba = Mamba1Mixer(cfg, jamba_mamba_shape(hf))
        else:
            self.self_attn = LlamaAttention(cfg, use_rope=False, qkv_bias=False, o_bias=False, qk_norm=False)
        is_moe = hf.layers_num_experts[layer_index] > 1
        self.mlp = SparseMoeBlock(cfg, renormalize=False) if is_moe else LlamaMLP(cfg, activation=hf.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cache: KVCache, ctx: StepContext):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mamba(x, cache, ctx) if self.is_linear else self.self_attn(x, cache, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class JambaForCausalLM(WithoutNativeStack, MoEForCausalLM):
    """Jamba's decoder and LM head (see the module's docstring)."""

    tensor_parallel_refusal = 'its Mamba-1 layers are not sharded for tensor parallelism'
    recurrent_chunk = 0  # the scan runs token by token: prefill chunks may end anywhere

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return JambaLayer(cfg, layer_index)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Renames the checkpoint's tensors to the engine's (:data:`RENAMED`)."""
        return super().split_fused((engine_name(name), tensor) for name, tensor in weights)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Per layer, one sequence's recurrent state (Mamba-1 layers) or None (attention layers)."""
        return [layer.mamba.state_shapes() if layer.is_linear else None for layer in self.layers]


def engine_name(name: str) -> str:
    """The engine's name of a checkpoint tensor."""
    for old, new in RENAMED.items():
        if old in name:
            return name.replace(old, new)
    return name
