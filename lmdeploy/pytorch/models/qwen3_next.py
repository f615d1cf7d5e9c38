"""Qwen3-Next (``Qwen3NextForCausalLM``) and Qwen3.5 text (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``):
hybrid decoders whose ``layer_types`` alternate Gated DeltaNet linear attention (a recurrent state per
sequence, see ``paging/state_pool.py``) with gated full attention over the paged KV cache (an output gate from
``q_proj``, Gemma-style ``1 + weight`` q/k norms, rotary over the first ``partial_rotary_factor`` of each head).
Norms are Gemma-style too; the MLP is dense (Qwen3.5) or a mixture of experts with a sigmoid-gated shared
expert (Qwen3-Next, Qwen3.5-MoE). Decode-only steps run in the native decoder stack where every part has a native
kernel; prefill and mixed steps run the layers' own forward (both read and write the same state pool and KV cache)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import causal_conv1d_decode, gated_delta_decode
from lmdeploy.pytorch.kernels.activation import placeless
from lmdeploy.pytorch.kernels.dsa import TokenSelection
from lmdeploy.pytorch.kernels.gated_delta import DELTA_RULE_CHUNK, causal_conv1d, chunk_gated_delta_rule
from lmdeploy.pytorch.models.llama import KVCache, LlamaMLP, WeightTarget
from lmdeploy.pytorch.models.moe import MoEForCausalLM, SparseMoeBlock
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.nn.decoder_stack import (LayerWeights, NativeDecoderStack, layer_weights,
                                               linear_attention_weights)
from lmdeploy.pytorch.nn.linear import Linear, MergedLinear
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.norm import GemmaRMSNorm
from lmdeploy.pytorch.nn.quant import LinearOptions
from lmdeploy.pytorch.nn.rotary import apply_rope, rotary_dim
from lmdeploy.pytorch.step_context import StepContext

LINEAR_ATTENTION = 'linear_attention'
MTP_PREFIX = 'mtp.'  # the checkpoints' next-token-prediction layer, not used


class GatedAttention(nn.Module):
    """Full attention whose ``q_proj`` also yields, per head, a gate: the output is ``o_proj(attn * sigmoid(gate))``;
    q (with its gate), k and v stacked in one ``qkv_proj``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = bool(getattr(hf, 'attention_bias', False))
        self.qkv_sizes = [2 * self.num_heads * self.head_dim] + 2 * [self.num_kv_heads * self.head_dim]
        self.qkv_proj = MergedLinear(cfg.hidden_size, self.qkv_sizes, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps)
        self.rotary_dim = rotary_dim(hf, self.head_dim)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   cfg.quant_policy)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext,
                selection: TokenSelection | None = None) -> torch.Tensor:
        """With ``selection`` (Qwen4-Exp's QSA) each query attends only the keys it keeps."""
        q_gate, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        k, v = k.unflatten(-1, (self.num_kv_heads, self.head_dim)), v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        qk = apply_rope(torch.cat((self.q_norm(q), self.k_norm(k)), dim=1), ctx.cos, ctx.sin)
        out = self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], v, kv_cache, ctx, selection)
        return self.o_proj(out * placeless(torch.sigmoid, gate.reshape(out.shape)))


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times its weight, times ``activation`` (SiLU) of the gate ``z``."""

    def __init__(self, size: int, eps: float, activation: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        gate = placeless(self.activation, z.float(), self.weight.dtype)
        return (self.weight * normed.to(self.weight.dtype) * gate).to(self.weight.dtype)


class CausalConv1d(nn.Module):
    """The depthwise convolution's weight ``[channels, 1, kernel]``, as checkpoints hold it, and its bias (Mamba-2)
    where it has one."""

    def __init__(self, channels: int, kernel: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule, over a recurrent state per sequence: ``(conv, delta)`` with
    ``conv [slots, conv_dim, kernel - 1]`` and ``delta [slots, heads, k_dim, v_dim]`` (fp32), a row per sequence
    (``ctx.state_prefill``, ``ctx.state_decode_slots``). Qwen3-Next projects q/k/v/z and b/a in two matrices
    grouped by key head (``in_proj_qkvz``, ``in_proj_ba``); Qwen3.5 in four (``in_proj_qkv``, ``_z``, ``_b``,
    ``_a``), as do llama.cpp's files of both (the config's ``linear_projections_split``). Value head ``i`` reads key
    head ``i // (H / Hk)``; with the config's ``linear_value_heads_tiled`` (Qwen3.5's files: llama.cpp's order) key
    head ``i % Hk``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.num_k_heads, self.num_v_heads = hf.linear_num_key_heads, hf.linear_num_value_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f'linear_num_value_heads ({self.num_v_heads}) must be a multiple of '
                             f'linear_num_key_heads ({self.num_k_heads}): each key head serves whole value heads')
        self.k_dim, self.v_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.kernel = hf.linear_conv_kernel_dim
        self.grouped_projections = hf.model_type == 'qwen3_next' and not getattr(hf, 'linear_projections_split', False)
        self.value_heads_tiled = bool(getattr(hf, 'linear_value_heads_tiled', False))
        if self.grouped_projections:
            self.in_proj_qkvz = Linear(cfg.hidden_size, self.conv_dim + self.value_size)
            self.in_proj_ba = Linear(cfg.hidden_size, 2 * self.num_v_heads)
        else:
            self.in_proj_qkv = Linear(cfg.hidden_size, self.conv_dim)
            self.in_proj_z = Linear(cfg.hidden_size, self.value_size)
            self.in_proj_b = Linear(cfg.hidden_size, self.num_v_heads)
            self.in_proj_a = Linear(cfg.hidden_size, self.num_v_heads)
        self.conv1d = CausalConv1d(self.conv_dim, self.kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.v_dim, hf.rms_norm_eps)
        self.out_proj = Linear(self.value_size, cfg.hidden_size)
        self.dtype = cfg.dtype

    def in_projections(self) -> list[Linear]:
        """The input projections, in the order of :meth:`project`."""
        if self.grouped_projections:
            return [self.in_proj_qkvz, self.in_proj_ba]
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]

    def stack_fields(self) -> dict[str, object]:
        """The fields of the native stack's ``LinearAttention`` (``kernels/cpu/linear_attention.h``) by name."""
        return dict(num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads, k_dim=self.k_dim, v_dim=self.v_dim,
                    grouped_projections=self.grouped_projections, value_heads_tiled=self.value_heads_tiled,
                    conv_weight=self.conv1d.weight.squeeze(1), a_log=self.A_log, dt_bias=self.dt_bias,
                    norm_weight=self.norm.weight, eps=self.norm.eps)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One slot's convolution state and delta-rule state."""
        return [((self.conv_dim, self.kernel - 1), self.dtype),
                ((self.num_v_heads, self.k_dim, self.v_dim), torch.float32)]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``qkv [T, conv_dim]`` (the convolution's input), ``z [T, H, Dv]``, ``b, a [T, H]``."""
        if not self.grouped_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(-1, self.num_v_heads, self.v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        per_key_head = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(-1, self.num_k_heads, 2 * self.k_dim + 2 * per_key_head * self.v_dim)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, per_key_head * self.v_dim, per_key_head * self.v_dim], -1)
        b, a = self.in_proj_ba(x).view(-1, self.num_k_heads, 2 * per_key_head).split(per_key_head, dim=-1)
        qkv = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)
        return (qkv, z.reshape(-1, self.num_v_heads, self.v_dim), b.reshape(-1, self.num_v_heads),
                a.reshape(-1, self.num_v_heads))

    def split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q, k = q.unflatten(-1, (self.num_k_heads, self.k_dim)), k.unflatten(-1, (self.num_k_heads, self.k_dim))
        if self.value_heads_tiled:
            q, k = (t.repeat(1, self.num_v_heads // self.num_k_heads, 1) for t in (q, k))
        return q, k, v.unflatten(-1, (self.num_v_heads, self.v_dim))

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        conv_states, delta_states = state
        qkv, z, b, a = self.project(x)
        beta = placeless(torch.sigmoid, b)
        g = -self.A_log.float().exp() * placeless(F.softplus, a.float() + self.dt_bias.float(), a.dtype)
        weight = self.conv1d.weight.squeeze(1)
        out = torch.empty(x.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32, device=x.device)
        num_prefill = ctx.num_prefill_tokens
        for slot, start, length, fresh in ctx.state_prefill:
            rows = slice(start, start + length)
            # a new (or recomputed) sequence starts from zeros: the slot's old content is not read
            conv_state = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
            mixed, conv_states[slot] = (t[0] for t in causal_conv1d(qkv[rows].T[None], conv_state[None], weight))
            out[rows], delta_states[slot] = chunk_gated_delta_rule(*self.split_heads(mixed.T), g[rows], beta[rows],
                                                                   None if fresh else delta_states[slot])
        if num_prefill < x.shape[0]:
            decode = ctx.state_decode_slots
            mixed = causal_conv1d_decode(qkv[num_prefill:], conv_states, decode, weight)
            out[num_prefill:] = gated_delta_decode(*self.split_heads(mixed), g[num_prefill:],
                                                   beta[num_prefill:], delta_states, decode)
        return self.out_proj(self.norm(out.to(self.dtype), z).flatten(1))


class HybridDecoderLayer(nn.Module):
    """``x + mixer(norm(x))``, then ``+ mlp(norm)``; the mixer is :class:`GatedDeltaNet` (``linear_attn``) or
    :class:`GatedAttention` (``self_attn``). Like Llama's layers it hands the residual sum on."""

    def __init__(self, cfg: ModelConfig, layer_index: int, mlp: nn.Module):
        super().__init__()
        hf = cfg.hf_config
        self.is_linear = hf.layer_types[layer_index] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = mlp
        self.dtype = cfg.dtype
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, hf.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cache: tuple[torch.Tensor, ...],
                ctx: StepContext):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, cache, ctx) if self.is_linear else self.self_attn(x, cache, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def native_weights(self) -> LayerWeights | None:
        """This layer's weights for the native decoder stack's decode-only steps (each projection's for small steps,
        which decode rows are); None where a part runs on no native kernel."""
        mlp = self.native_mlp()
        if mlp is None:
            return None
        projections, options = mlp
        norms = (self.input_layernorm.scale(self.dtype), self.post_attention_layernorm.scale(self.dtype))
        if self.is_linear:
            mixer = self.linear_attn
            return linear_attention_weights(*norms, mixer.in_projections(), dict(o=mixer.out_proj, **projections),
                                            mixer.stack_fields(), rotary_dim=0, **options)
        attn = self.self_attn
        return layer_weights(*norms, dict(qkv=attn.qkv_proj, o=attn.o_proj, **projections), small_step=True,
                             q_norm=attn.q_norm.scale(self.dtype), k_norm=attn.k_norm.scale(self.dtype),
                             rotary_dim=attn.rotary_dim, output_gate=True, **options)

    def native_mlp(self) -> tuple[dict[str, Linear], dict[str, object]] | None:
        """The MLP's projections and options for the stack (a dense MLP's gate_up and down, or the ``moe`` block);
        None where it runs on no native kernel."""
        if isinstance(self.mlp, SparseMoeBlock):
            moe = self.mlp.native_moe(small_step=True)  # the stack runs decode rows only
            return None if moe is None else ({}, dict(moe=moe))
        if not self.mlp.gate_up_proj.gate_up_panels:
            return None
        return dict(gate_up=self.mlp.gate_up_proj, down=self.mlp.down_proj), {}


class Qwen3NextForCausalLM(MoEForCausalLM):
    """Qwen3-Next, Qwen3.5 and Qwen3.5-MoE text decoders (see the module's docstring)."""

    tensor_parallel_refusal = 'its linear-attention layers are not sharded for tensor parallelism'
    recurrent_chunk = DELTA_RULE_CHUNK  # where the scheduler cuts prefill chunks (``Scheduler.recurrent_grain``)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.hf_config.rms_norm_eps)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return HybridDecoderLayer(cfg, layer_index, self.make_mlp(cfg, layer_index))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        if getattr(cfg.hf_config, 'num_experts', 0):
            return super().make_mlp(cfg, layer_index)
        return LlamaMLP(cfg)

    def weight_target(self, name: str) -> WeightTarget | None:
        return None if name.startswith(MTP_PREFIX) else super().weight_target(name)

    def finalize_weights(self, pack_cpu: bool, small_step_int4: bool) -> None:
        """Lays the loaded weights out for their kernels (bf16 CPU weights packed for their GEMM; no 4-bit
        small-step copies); with native GEMM weights throughout, decode-only steps run in a
        :class:`NativeDecoderStack`."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedExperts)):
                module.finalize(LinearOptions(pack_cpu, dtype=self.cfg.dtype))
        self.lm_head.finalize(pack_cpu)
        attn = next((layer.self_attn for layer in self.layers if not layer.is_linear), None)
        if not pack_cpu or attn is None:
            return
        self.native_stack = NativeDecoderStack.build(
            [layer.native_weights() for layer in self.layers], None, attn.num_heads, attn.num_kv_heads,
            attn.head_dim, self.norm.eps, attn.attn.scale, 0, self.cfg.quant_policy, decode_only=True)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Per layer, one sequence's recurrent state (linear-attention layers) or None (KV-cache layers)."""
        return [layer.linear_attn.state_shapes() if layer.is_linear else None for layer in self.layers]
