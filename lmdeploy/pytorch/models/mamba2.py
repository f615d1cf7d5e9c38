"""The Mamba-2 mixer of hybrid decoders (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1): a layer with a recurrent state
per sequence (see ``paging/state_pool.py``); its selective state space runs in ``kernels/mamba2.py``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.activation import placeless
from lmdeploy.pytorch.kernels.gated_delta import causal_conv1d
from lmdeploy.pytorch.kernels.mamba2 import ssd_chunk_scan, ssd_decode
from lmdeploy.pytorch.models.qwen3_next import CausalConv1d
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.step_context import StepContext

# how the gate z meets the scan's output y: ``rmsnorm(y * silu(z))`` (Mamba-2's), ``rmsnorm(y) * silu(z)``, or
# ``y * silu(z)`` without a norm (Falcon-H1's ``mamba_norm_before_gate``, ``mamba_rms_norm`` off)
GATE_THEN_NORM, NORM_THEN_GATE, GATE_ONLY = 'gate_then_norm', 'norm_then_gate', 'gate_only'


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 layer's sizes and options, which each family's config names its own way."""
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    time_step_limit: tuple[float, float] | None
    out_proj_bias: bool | None = None  # None: as ``proj_bias``
    gate_norm: str = GATE_THEN_NORM


class SiluGate(nn.Module):
    """``y * silu(z)`` (no norm). In fp32 the SiLU runs ``placeless``, as do the mixer's other element-wise ops over
    the step's rows: a row's bits do not depend on its place among them."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (y.float() * placeless(F.silu, z.float(), self.dtype)).to(self.dtype)


class GroupedGatedRMSNorm(nn.Module):
    """``weight * rmsnorm(y * silu(z))`` (Mamba-2's gate before its norm) or, ``norm_before_gate``,
    ``weight * rmsnorm(y) * silu(z)``, the norm taken over each of ``groups`` equal slices of the features."""

    def __init__(self, size: int, groups: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate = placeless(F.silu, z.float(), self.weight.dtype)
        y = y.float() if self.norm_before_gate else y.float() * gate
        grouped = y.unflatten(-1, (self.groups, -1))
        normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        if self.norm_before_gate:
            return (self.weight.float() * normed * gate).to(self.weight.dtype)
        return self.weight * normed.to(self.weight.dtype)


class Mamba2Mixer(nn.Module):
    """Mamba-2 over a recurrent state per sequence: ``(conv, ssm)`` with ``conv [slots, conv_dim, d_conv - 1]``
    (the last inputs of x, B and C) and ``ssm [slots, heads, head_dim, d_state]`` (fp32), a row per sequence
    (``ctx.state_prefill``, ``ctx.state_decode_slots``). ``in_proj`` gives the gate z, the convolution's input
    (x, B, C) and dt; prefill runs the chunked scan per sequence, decode the recurrence for all sequences at once
    (``kernels/mamba2.py``)."""

    def __init__(self, cfg: ModelConfig, shape: Mamba2Shape):
        super().__init__()
        self.num_heads, self.head_dim = shape.num_heads, shape.head_dim
        self.num_groups, self.state_size, self.kernel = shape.num_groups, shape.state_size, shape.conv_kernel
        if self.num_heads % self.num_groups:
            raise ValueError(f'the Mamba-2 layers\' {self.num_groups} groups of B/C must divide their '
                             f'{self.num_heads} heads')
        self.inner_size = self.num_heads * self.head_dim
        self.conv_dim = self.inner_size + 2 * self.num_groups * self.state_size
        self.in_proj = Linear(cfg.hidden_size, self.inner_size + self.conv_dim + self.num_heads, bias=shape.proj_bias)
        self.conv1d = CausalConv1d(self.conv_dim, self.kernel, bias=shape.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.time_step_limit = tuple(shape.time_step_limit or (0.0, float('inf')))
        if shape.gate_norm == GATE_ONLY:
            self.norm = SiluGate(cfg.dtype)
        else:
            self.norm = GroupedGatedRMSNorm(self.inner_size, self.num_groups, shape.eps,
                                            norm_before_gate=shape.gate_norm == NORM_THEN_GATE)
        out_bias = shape.proj_bias if shape.out_proj_bias is None else shape.out_proj_bias
        self.out_proj = Linear(self.inner_size, cfg.hidden_size, bias=out_bias)
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
