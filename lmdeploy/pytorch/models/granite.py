"""Granite 3.x (``GraniteForCausalLM``): Llama layers scaled by four config fields: embeddings times
``embedding_multiplier``, attention scores by ``attention_multiplier`` (in place of ``head_dim ** -0.5``), the
attention and MLP outputs times ``residual_multiplier`` before the residual adds them, and logits divided by
``logits_scaling``. Its layers run in the native decoder stack (``residual_scale``).

Granite 3 MoE (``GraniteMoeForCausalLM``: granite-3.x-1b-a400m, 3b-a800m): the same layers and multipliers with a
mixture of experts in place of each MLP, routed by a softmax over the top-k router logits (the softmax over all
experts renormalized over the top k: the same weights); the checkpoints stack each layer's experts
(``block_sparse_moe.input_linear [E, 2I, H]``, gate rows first, and ``output_linear [E, H, I]``). Its layers run in
the native decoder stack (``residual_scale``, MoE blocks).

GraniteMoeShared (``GraniteMoeSharedForCausalLM``): Granite 3 MoE whose layers add an ungated SiLU-gated shared MLP
of ``shared_intermediate_size`` (the checkpoints' layer-level ``shared_mlp.input_linear``/``output_linear``) to the
experts' output; the engine keeps it in the MoE block (:class:`GraniteSharedMoeBlock`), which runs in the native
decoder stack as a ``MoEBlock`` with shared experts."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.models.llama import (KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                           layer_window)
from lmdeploy.pytorch.models.moe import (MoEForCausalLM, SparseMoeBlock, native_experts_with_shared,
                                         split_stacked_experts)
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# checkpoint name fragment -> the engine's (the MoE block's router and stacked experts; Granite 4.0-H's shared MLP's
# fused gate/up and its down projection)
RENAMED = {'.block_sparse_moe.router.layer.': '.mlp.gate.',
           '.block_sparse_moe.input_linear.weight': '.mlp.experts.gate_up_proj',
           '.block_sparse_moe.output_linear.weight': '.mlp.experts.down_proj',
           '.shared_mlp.input_linear.': '.shared_mlp.gate_up_proj.',
           '.shared_mlp.output_linear.': '.shared_mlp.down_proj.'}
# a layer's shared MLP, not already under its MoE block (GGUF folders that keep it as blocks name it there)
LAYER_SHARED_MLP = re.compile(r'(layers\.\d+)\.shared_mlp\.')


class GraniteDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose attention and MLP outputs are scaled by ``residual_multiplier``."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, attn: LlamaAttention):
        super().__init__(cfg, mlp, attn)
        self.residual_multiplier = cfg.hf_config.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        x, residual = self.norm_input(x, residual)
        x = self.self_attn(x, kv_cache, ctx) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """See :meth:`LlamaDecoderLayer.native_weights`; the stack scales the two outputs too."""
        return self.stack_weights(small_step, residual_scale=float(self.residual_multiplier))


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x's decoder, LM head and multipliers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        # Bamba (models/granitemoehybrid.py) has neither: 1
        self.embedding_multiplier = getattr(hf, 'embedding_multiplier', 1.0)
        self.logits_scaling = getattr(hf, 'logits_scaling', 1.0)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        attn = LlamaAttention(cfg, scale=hf.attention_multiplier, sliding_window=layer_window(hf, layer_index))
        return GraniteDecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits / self.logits_scaling


class GraniteMoeForCausalLM(GraniteForCausalLM, MoEForCausalLM):
    """Granite 3 MoE's decoder: Granite's layers and multipliers, each layer's MLP a :class:`SparseMoeBlock`."""

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Renames the checkpoint's MoE (and shared-MLP) tensors (:data:`RENAMED`) to the engine's, splits the fused
        ones and the stacked experts (``input_linear [E, 2I, H]``, ``output_linear [E, H, I]``)."""
        renamed = ((self.engine_name(name), tensor) for name, tensor in weights)
        return split_stacked_experts(super().split_fused(renamed), self.cfg.hidden_size)

    @staticmethod
    def engine_name(name: str) -> str:
        """The engine's name of a checkpoint tensor."""
        for old, new in RENAMED.items():
            if old in name:
                return name.replace(old, new)
        return name


class GraniteSharedMoeBlock(SparseMoeBlock):
    """GraniteMoeShared's MLP: Granite 3 MoE's routed experts plus an ungated gated-SiLU ``shared_mlp`` of
    ``shared_intermediate_size`` features."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        self.shared_mlp = LlamaMLP(cfg, hf.shared_intermediate_size, activation=hf.hidden_act)

    def native_moe(self, small_step: bool = False) -> object | None:
        """This block as a ``MoEBlock`` of the native decoder stack, its shared MLP as ungated shared experts; None
        where a part runs on no native kernel."""
        native = native_experts_with_shared(self.experts, self.shared_mlp, small_step)
        router = self.gate.kernel.router_projection(self.gate.bias)
        if native is None or router is None:
            return None
        return cpu.native().MoEBlock(router=router, top_k=self.top_k, renormalize=self.renormalize,
                                     routing='softmax', **native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_mlp(x)


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """GraniteMoeShared's decoder: Granite 3 MoE's, each MoE block with its shared MLP (none where
    ``shared_intermediate_size`` is 0, as transformers builds it)."""

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return GraniteSharedMoeBlock(cfg) if cfg.hf_config.shared_intermediate_size else SparseMoeBlock(cfg)

    @staticmethod
    def engine_name(name: str) -> str:
        """The engine's name of a checkpoint tensor: Granite 3 MoE's, the layer's shared MLP under its MoE block."""
        return LAYER_SHARED_MLP.sub(r'\1.mlp.shared_mlp.', GraniteMoeForCausalLM.engine_name(name))
