"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``): a hybrid decoder whose ``layer_types`` interleave Mamba-2 layers
(selective state space, a recurrent state per sequence, see ``paging/state_pool.py``) with a few attention layers
over the paged KV cache (rotary only where ``position_embedding_type`` is ``rope``), Granite's multipliers
(embeddings, attention scores, residual branches, logits), and in each layer a mixture of experts (softmax over the
top-k) plus an ungated shared MLP, or the shared MLP alone (``num_local_experts`` 0). IBM's Bamba
(``BambaForCausalLM``) is the dense layout under other names, without the multipliers. Every step runs the layers'
own forward (no native decoder stack)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import RECURRENT_LAYER_TYPES, ModelConfig
from lmdeploy.pytorch.kernels.mamba2 import SSD_CHUNK
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaMLP
from lmdeploy.pytorch.models.mamba2 import Mamba2Mixer, Mamba2Shape
from lmdeploy.pytorch.models.moe import MoEForCausalLM, SparseMoeBlock, split_stacked_experts
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.quant import LinearOptions
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# checkpoint name fragment -> the engine's (the MoE block's router and stacked experts, the shared MLP's fused
# gate/up and its down projection; Bamba's MLP and norms)
RENAMED = {'.block_sparse_moe.router.layer.': '.mlp.gate.',
           '.block_sparse_moe.input_linear.weight': '.mlp.experts.gate_up_proj',
           '.block_sparse_moe.output_linear.weight': '.mlp.experts.down_proj',
           '.shared_mlp.input_linear.': '.shared_mlp.gate_up_proj.',
           '.shared_mlp.output_linear.': '.shared_mlp.down_proj.'}
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


class GraniteMoeHybridForCausalLM(MoEForCausalLM):
    """Granite 4.0-H's decoder, LM head and multipliers (see the module's docstring)."""

    tensor_parallel_refusal = 'its Mamba-2 layers are not sharded for tensor parallelism'
    recurrent_chunk = SSD_CHUNK
    renamed = RENAMED  # see engine_name

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        self.embedding_multiplier = getattr(hf, 'embedding_multiplier', 1.0)
        self.logits_scaling = getattr(hf, 'logits_scaling', 1.0)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return GraniteHybridLayer(cfg, layer_index)

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits / self.logits_scaling

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Renames the checkpoint's tensors (:attr:`renamed`) to the engine's, splits the shared MLP's fused gate/up
        and the stacked experts (``input_linear [E, 2I, H]``, ``output_linear [E, H, I]``)."""
        renamed = ((self.engine_name(name), tensor) for name, tensor in weights)
        return split_stacked_experts(super().split_fused(renamed), self.cfg.hidden_size)

    @classmethod
    def engine_name(cls, name: str) -> str:
        """The engine's name of a checkpoint tensor: the first fragment of :attr:`renamed` it holds replaced."""
        for old, new in cls.renamed.items():
            if old in name:
                return name.replace(old, new)
        return name

    def finalize_weights(self, pack_cpu: bool, small_step_int4: bool) -> None:
        """Lays the loaded weights out for their kernels (bf16 CPU weights packed for their GEMM); no native
        decoder stack."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedExperts)):
                module.finalize(LinearOptions(pack_cpu, dtype=self.cfg.dtype))
        self.lm_head.finalize(pack_cpu)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Per layer, one sequence's recurrent state (Mamba-2 layers) or None (attention layers)."""
        return [layer.mamba.state_shapes() if layer.is_linear else None for layer in self.layers]


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """Bamba (IBM, ``BambaForCausalLM``): Mamba-2 layers and the attention layers of ``attn_layer_indices``, each
    followed by a gated MLP (``feed_forward``, as Granite 4.0-H's dense ``shared_mlp``), without multipliers."""

    renamed = BAMBA_RENAMED
