"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``): a hybrid decoder whose ``layer_types`` interleave Mamba-2 layers
(selective state space, a recurrent state per sequence, see ``paging/state_pool.py``) with a few attention layers
over the paged KV cache (rotary only where ``position_embedding_type`` is ``rope``), Granite's multipliers
(embeddings, attention scores, residual branches, logits), and in each layer a mixture of experts (softmax over the
top-k) plus an ungated shared MLP, or the shared MLP alone (``num_local_experts`` 0). Every step runs the layers'
own forward (no native decoder stack)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import RECURRENT_LAYER_TYPES, ModelConfig
from lmdeploy.pytorch.kernels.activation import placeless
from lmdeploy.pytorch.kernels.gated_delta import causal_conv1d
from lmdeploy.pytorch.kernels.mamba2 import SSD_CHUNK, ssd_chunk_scan, ssd_decode
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaMLP
from lmdeploy.pytorch.models.moe import MoEForCausalLM, SparseMoeBlock, split_stacked_experts
from lmdeploy.pytorch.models.qwen3_next import CausalConv1d
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.quant import LinearOptions
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# checkpoint name fragment -> the engine's (the MoE block's router and stacked experts, the shared MLP's fused
# gate/up and its down projection)
RENAMED = {'.block_sparse_moe.router.layer.': '.mlp.gate.',
           '.block_sparse_moe.input_linear.weight': '.mlp.experts.gate_up_proj',
           '.block_sparse_moe.output_linear.weight': '.mlp.experts.down_proj',
           '.shared_mlp.input_linear.': '.shared_mlp.gate_up_proj.',
           '.shared_mlp.output_linear.': '.shared_mlp.down_proj.'}


class GroupedGatedRMSNorm(nn.Module):
    """``weight * rmsnorm(y * silu(z))``, the norm taken over each of ``groups`` equal slices of the features
    (Mamba-2's gate before its norm). In fp32 the SiLU runs ``placeless``, as do the mixer's other element-wise ops
    over the step's rows: a row's bits do not depend on its place among them."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = (y.float() * placeless(F.silu, z.float(), self.weight.dtype)).unflatten(-1, (self.groups, -1))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.flatten(-2).to(self.weight.dtype)


class Mamba2Mixer(nn.Module):
    """Mamba-2 over a recurrent state per sequence: ``(conv, ssm)`` with ``conv [slots, conv_dim, d_conv - 1]``
    (the last inputs of x, B and C) and ``ssm [slots, heads, head_dim, d_state]`` (fp32), a row per sequence
    (``ctx.state_prefill``, ``ctx.state_decode_slots``). ``in_proj`` gives the gate z, the convolution's input
    (x, B, C) and dt; prefill runs the chunked scan per sequence, decode the recurrence for all sequences at once
    (``kernels/mamba2.py``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.num_heads, self.head_dim = hf.mamba_n_heads, hf.mamba_d_head
        self.num_groups, self.state_size, self.kernel = hf.mamba_n_groups, hf.mamba_d_state, hf.mamba_d_conv
        self.inner_size = hf.mamba_expand * cfg.hidden_size
        if self.num_heads * self.head_dim != self.inner_size or self.num_heads % self.num_groups:
            raise ValueError(f'mamba_n_heads ({self.num_heads}) times mamba_d_head ({self.head_dim}) must be '
                             f'mamba_expand * hidden_size ({self.inner_size}), and mamba_n_groups '
                             f'({self.num_groups}) must divide mamba_n_heads')
        self.conv_dim = self.inner_size + 2 * self.num_groups * self.state_size
        self.in_proj = Linear(cfg.hidden_size, self.inner_size + self.conv_dim + self.num_heads,
                              bias=bool(hf.mamba_proj_bias))
        self.conv1d = CausalConv1d(self.conv_dim, self.kernel, bias=bool(hf.mamba_conv_bias))
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.time_step_limit = tuple(getattr(hf, 'time_step_limit', None) or (0.0, float('inf')))
        self.norm = GroupedGatedRMSNorm(self.inner_size, self.num_groups, hf.rms_norm_eps)
        self.out_proj = Linear(self.inner_size, cfg.hidden_size, bias=bool(hf.mamba_proj_bias))
        self.dtype = cfg.dtype

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One slot's convolution state and SSM state."""
        return [((self.conv_dim, self.kernel - 1), self.dtype),
                ((self.num_heads, self.head_dim, self.state_size), torch.float32)]

    def split_conv_output(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, H, P]``, ``B, C [T, G, N]`` of the convolution's output ``[T, conv_dim]``."""
        groups = self.num_groups * self.state_size
        x, B, C = xbc.split([self.inner_size, groups, groups], dim=-1)
        return (x.unflatten(-1, (self.num_heads, self.head_dim)), B.unflatten(-1, (self.num_groups, -1)),
                C.unflatten(-1, (self.num_groups, -1)))

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        conv_states, ssm_states = state
        z, xbc, dt = self.in_proj(hidden).split([self.inner_size, self.conv_dim, self.num_heads], dim=-1)
        dt = placeless(F.softplus, dt.float() + self.dt_bias.float(), dt.dtype).clamp(*self.time_step_limit)
        A = -self.A_log.float().exp()
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        conv_out = torch.empty_like(xbc)
        out = torch.empty(hidden.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=hidden.device)
        for slot, start, length, fresh in ctx.state_prefill:
            rows = slice(start, start + length)
            # a new (or recomputed) sequence starts from zeros: the slot's old content is not read
            conv_state = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
            mixed, conv_states[slot] = (t[0] for t in causal_conv1d(xbc[rows].T[None], conv_state[None], weight, bias))
            conv_out[rows] = mixed.T
            x, B, C = self.split_conv_output(conv_out[rows])
            out[rows], ssm_states[slot] = ssd_chunk_scan(x, dt[rows], A, B, C, None if fresh else ssm_states[slot])
        num_prefill = ctx.num_prefill_tokens
        if num_prefill < hidden.shape[0]:
            slots = ctx.state_decode_slots
            mixed, conv_states[slots] = causal_conv1d(xbc[num_prefill:, :, None], conv_states[slots], weight, bias)
            conv_out[num_prefill:] = mixed.squeeze(-1)
            x, B, C = self.split_conv_output(conv_out[num_prefill:])
            out[num_prefill:] = ssd_decode(x, dt[num_prefill:], A, B, C, ssm_states, slots)
        x = self.split_conv_output(conv_out)[0]
        out = out + self.D.float()[:, None] * x.float()
        return self.out_proj(self.norm(out.flatten(1), z))


class GraniteHybridLayer(nn.Module):
    """``x + residual_multiplier * mixer(norm(x))``, then the same with the routed experts (``mlp``, where the
    config has them) plus the ungated ``shared_mlp``; the mixer is a :class:`Mamba2Mixer` (``mamba``) or attention
    scaled by ``attention_multiplier`` (``self_attn``)."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        self.is_linear = hf.layer_types[layer_index] in RECURRENT_LAYER_TYPES
        if self.is_linear:
            self.mamba = Mamba2Mixer(cfg)
        else:
            self.self_attn = LlamaAttention(cfg, use_rope=getattr(hf, 'position_embedding_type', None) == 'rope',
                                            scale=hf.attention_multiplier)
        self.mlp = SparseMoeBlock(cfg) if hf.num_local_experts else None
        self.shared_mlp = LlamaMLP(cfg, hf.shared_intermediate_size, activation=hf.hidden_act)
        self.residual_multiplier = hf.residual_multiplier
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

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        self.embedding_multiplier, self.logits_scaling = hf.embedding_multiplier, hf.logits_scaling

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return GraniteHybridLayer(cfg, layer_index)

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits / self.logits_scaling

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Renames the checkpoint's MoE and shared-MLP tensors (:data:`RENAMED`) to the engine's, splits the shared
        MLP's fused gate/up and the stacked experts (``input_linear [E, 2I, H]``, ``output_linear [E, H, I]``)."""
        renamed = ((self.engine_name(name), tensor) for name, tensor in weights)
        return split_stacked_experts(super().split_fused(renamed), self.cfg.hidden_size)

    @staticmethod
    def engine_name(name: str) -> str:
        """The engine's name of a checkpoint tensor."""
        for old, new in RENAMED.items():
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
