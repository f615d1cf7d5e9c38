"""Nemotron-H (``NemotronHForCausalLM``: NVIDIA Nemotron-H, Nemotron Nano 2, Nemotron 3): a hybrid decoder of
single-mixer blocks, ``x + mixer(norm(x))``, each a Mamba-2 layer (``M`` in the checkpoints'
``hybrid_override_pattern``), attention without positions (``*``), a squared-ReLU MLP (``-``) or a mixture of
squared-ReLU experts (``E``), per ``layers_block_type``. The Mamba-2 layers keep a recurrent state per sequence
(``models/mamba2.py``); every step runs the layers' own forward (no native decoder stack)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import grouped_topk
from lmdeploy.pytorch.kernels.mamba2 import SSD_CHUNK
from lmdeploy.pytorch.models.arcee import ReluSquared, UngatedMLP, UngatedMLPForCausalLM
from lmdeploy.pytorch.models.deepseek_v3 import TopKRouter
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, WithoutNativeStack
from lmdeploy.pytorch.models.mamba2 import Mamba2Mixer, Mamba2Shape
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

MAMBA, ATTENTION, MLP, MOE = 'linear_attention', 'full_attention', 'mlp', 'moe'
# checkpoint name prefix -> the engine's
PREFIXES = {'backbone.embeddings.': 'model.embed_tokens.', 'backbone.norm_f.': 'model.norm.', 'backbone.': 'model.'}


class NemotronHMoE(nn.Module):
    """Routed experts (squared-ReLU MLPs, each on its own linear layers) chosen by DeepSeek-V3's routing
    (:func:`grouped_topk`: sigmoid scores, ``e_score_correction_bias``, ``n_group``/``topk_group``,
    ``routed_scaling_factor``), between the optional latent projections ``fc1_latent_proj``/``fc2_latent_proj``
    (``moe_latent_size``), plus the shared experts every token runs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        bias, latent = bool(hf.mlp_bias), hf.moe_latent_size
        self.top_k, self.num_groups, self.topk_groups = hf.num_experts_per_tok, hf.n_group, hf.topk_group
        self.renormalize, self.scaling = bool(hf.norm_topk_prob), hf.routed_scaling_factor
        self.gate = TopKRouter(cfg.hidden_size, hf.n_routed_experts, correction_bias=True)
        self.fc1_latent_proj = Linear(cfg.hidden_size, latent, bias=bias) if latent else None
        self.fc2_latent_proj = Linear(latent, cfg.hidden_size, bias=bias) if latent else None
        self.experts = nn.ModuleList(
            UngatedMLP(latent or cfg.hidden_size, hf.moe_intermediate_size, bias, ReluSquared())
            for _ in range(hf.n_routed_experts))
        self.shared_experts = UngatedMLP(cfg.hidden_size, hf.moe_shared_expert_intermediate_size, bias, ReluSquared())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = grouped_topk(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.num_groups,
                                    self.topk_groups, self.renormalize, self.scaling)
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = torch.zeros_like(routed)
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            expert_out = self.experts[expert](routed[tokens]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, expert_out.to(out.dtype))
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)


def nemotron_mamba_shape(hf: PretrainedConfig) -> Mamba2Shape:
    """The Mamba-2 layers' shape from Nemotron-H's config fields."""
    return Mamba2Shape(hf.mamba_num_heads, hf.mamba_head_dim, hf.n_groups, hf.ssm_state_size, hf.conv_kernel,
                       bool(hf.use_conv_bias), bool(hf.use_bias), hf.layer_norm_epsilon, hf.time_step_limit)


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``; like Llama's layers it hands the residual sum on."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        kind = hf.layers_block_type[layer_index]
        self.is_linear = kind == MAMBA
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg, nemotron_mamba_shape(hf))
        elif kind == ATTENTION:
            self.mixer = LlamaAttention(cfg, use_rope=False, qk_norm=False, qkv_bias=False, o_bias=False)
        elif kind == MLP:
            self.mixer = UngatedMLP(cfg.hidden_size, hf.intermediate_size, bool(hf.mlp_bias), ReluSquared())
        elif kind == MOE:
            self.mixer = NemotronHMoE(cfg)
        else:
            raise ValueError(f'NemotronHForCausalLM: layer {layer_index} is a {kind!r} block; only Mamba-2 (M), '
                             f'attention (*), MLP (-) and MoE (E) blocks are supported')
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, hf.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cache: KVCache, ctx: StepContext):
        if residual is None:
            x, residual = self.norm(x), x
        else:
            x, residual = self.norm(x, residual)
        return (self.mixer(x, cache, ctx) if self.kind in (MAMBA, ATTENTION) else self.mixer(x)), residual


class NemotronHForCausalLM(WithoutNativeStack, UngatedMLPForCausalLM):
    """Nemotron-H's decoder and LM head (see the module's docstring)."""

    tensor_parallel_refusal = 'its Mamba-2 layers are not sharded for tensor parallelism'
    recurrent_chunk = SSD_CHUNK

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return NemotronHBlock(cfg, layer_index)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.hf_config.layer_norm_epsilon)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Renames the checkpoint's tensors to the engine's (:func:`engine_name`)."""
        return super().split_fused((engine_name(name), tensor) for name, tensor in weights)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Per layer, one sequence's recurrent state (Mamba-2 layers), None (attention: a KV cache) or nothing
        (MLP and MoE blocks)."""
        return [layer.mixer.state_shapes() if layer.is_linear else None if layer.kind == ATTENTION else []
                for layer in self.layers]


def engine_name(name: str) -> str:
    """The engine's name of a checkpoint tensor."""
    for old, new in PREFIXES.items():
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return name
