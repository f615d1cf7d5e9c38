"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``): a hybrid decoder whose ``layer_types`` interleave Mamba-2 layers
(selective state space, a recurrent state per sequence, see ``paging/state_pool.py``) with a few attention layers
over the paged KV cache (rotary only where ``position_embedding_type`` is ``rope``), Granite's multipliers
(embeddings, attention scores, residual branches, logits), and in each layer a mixture of experts (softmax over the
top-k) plus an ungated shared MLP, or the shared MLP alone (``num_local_experts`` 0). IBM's Bamba
(``BambaForCausalLM``) is the dense layout under other names, without the multipliers. Every step runs the layers'
own forward (no native decoder stack)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import RECURRENT_LAYER_TYPES, ModelConfig
from lmdeploy.pytorch.kernels.mamba2 import SSD_CHUNK
from lmdeploy.pytorch.models.granite import GraniteMoeForCausalLM
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaMLP, WithoutNativeStack
from lmdeploy.pytorch.models.mamba2 import Mamba2Mixer, Mamba2Shape
from lmdeploy.pytorch.models.moe import SparseMoeBlock
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.step_context import StepContext

# Bamba's checkpoint name fragment -> Granite 4.0-H's
BAMBA_RENAMED = {'.feed_forward.': '.shared_mlp.', '.pre_ff_layernorm.': '.post_attention_layernorm.',
                 'model.final_layernorm.': 'model.norm.'}


def granite_mamba_shape(hf: PretrainedConfig) -> Mamba2Shape:
    """The Mamba-2 layers' shape from Granite's ``mamba_*`` config fields."""
    return Mamba2Shape(hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state, hf.mamba_d_conv,
                       bool(hf.mamba_conv_bias), bool(hf.mamba_proj_bias), hf.rms_norm_eps,
                       getattr(hf, 'time_step_limit', None))


class GraniteHybridLayer(nn.Module):
    """``x + residual_multiplier * mixer(norm(x))``, then the same with the routed experts (``mlp``, where the
    config has them) plus the ungated ``shared_mlp``; the mixer is a :class:`Mamba2Mixer` (``mamba``) or attention
    scaled by ``attention_multiplier`` (``self_attn``). Bamba's configs have none of these Granite fields: no
    multipliers (1, and ``head_dim ** -0.5`` for the attention), no experts, its ``intermediate_size`` for the
    shared MLP and rotary attention (over the first half of each head, per its ``partial_rotary_factor``)."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        self.is_linear = hf.layer_types[layer_index] in RECURRENT_LAYER_TYPES
        if self.is_linear:
            self.mamba = Mamba2Mixer(cfg, granite_mamba_shape(hf))
        else:
            self.self_attn = LlamaAttention(cfg, use_rope=getattr(hf, 'position_embedding_type', 'rope') == 'rope',
                                            scale=getattr(hf, 'attention_multiplier', None))
        self.mlp = SparseMoeBlock(cfg) if getattr(hf, 'num_local_experts', 0) else None
        self.shared_mlp = LlamaMLP(cfg, getattr(hf, 'shared_intermediate_size', hf.intermediate_size),
                                   activation=hf.hidden_act)
        self.residual_multiplier = getattr(hf, 'residual_multiplier', 1.0)
        self.input_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cache: KVCache, ctx: StepContext):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mamba(x, cache, ctx) if self.is_linear else self.self_attn(x, cache, ctx)
        x, residual = self.post_attention_layernorm(x * self.residual_multiplier, residual)
        out = self.shared_mlp(x) if self.mlp is None else self.mlp(x) + self.shared_mlp(x)
        return out * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(WithoutNativeStack, GraniteMoeForCausalLM):
    """Granite 4.0-H's decoder, LM head and multipliers (see the module's docstring); its checkpoints' tensors load
    as Granite 3 MoE's."""

    tensor_parallel_refusal = 'its Mamba-2 layers are not sharded for tensor parallelism'
    recurrent_chunk = SSD_CHUNK

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return GraniteHybridLayer(cfg, layer_index)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Per layer, one sequence's recurrent state (Mamba-2 layers) or None (attention layers)."""
        return [layer.mamba.state_shapes() if layer.is_linear else None for layer in self.layers]


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """Bamba (IBM, ``BambaForCausalLM``): Mamba-2 layers and the attention layers of ``attn_layer_indices``, each
    followed by a gated MLP (``feed_forward``, as Granite 4.0-H's dense ``shared_mlp``), without multipliers."""

    @staticmethod
    def engine_name(name: str) -> str:
        """The engine's name of a checkpoint tensor (:data:`BAMBA_RENAMED`)."""
        for old, new in BAMBA_RENAMED.items():
            if old in name:
                return name.replace(old, new)
        return name
