"""The Mamba-1 mixer of Jamba, Mamba and Falcon Mamba: a layer with a recurrent state per sequence (see
``paging/state_pool.py``); its selective scan runs in ``kernels/mamba1.py``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import mamba1_scan
from lmdeploy.pytorch.kernels.activation import placeless
from lmdeploy.pytorch.kernels.gated_delta import causal_conv1d
from lmdeploy.pytorch.models.qwen3_next import CausalConv1d
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.step_context import StepContext

# the RMSNorms on dt, B and C after ``x_proj``: none (Mamba), with weights (Jamba), without (Falcon Mamba)
NO_NORMS, WEIGHTED_NORMS, WEIGHTLESS_NORMS = 'none', 'weighted', 'weightless'


@dataclass(frozen=True)
class Mamba1Shape:
    """A Mamba-1 layer's sizes and options, which each family's config names its own way."""
    inner_size: int
    state_size: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    dt_norms: str = NO_NORMS
    eps: float = 1e-6


class WeightlessRMSNorm(nn.Module):
    """``x / rms(x)`` in fp32 (Falcon Mamba's norms on dt, B and C)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Mamba1Mixer(nn.Module):
    """Mamba-1 over a recurrent state per sequence: ``(conv, ssm)`` with ``conv [slots, inner, d_conv - 1]`` (the
    last inputs of x) and ``ssm [slots, inner, d_state]`` (fp32), a row per sequence (``ctx.state_prefill``,
    ``ctx.state_decode_slots``). ``in_proj`` gives x and the gate z; x runs through the causal depthwise convolution
    (with SiLU), ``x_proj`` gives dt (of ``dt_rank`` features), B and C, ``dt_proj`` widens dt to every channel and
    ``softplus(dt)`` steps the selective scan (``A = -exp(A_log)``); ``(y + D * x) * silu(z)`` goes to
    ``out_proj``."""

    def __init__(self, cfg: ModelConfig, shape: Mamba1Shape):
        super().__init__()
        self.inner_size, self.state_size, self.kernel = shape.inner_size, shape.state_size, shape.conv_kernel
        self.dt_rank = shape.dt_rank
        self.in_proj = Linear(cfg.hidden_size, 2 * self.inner_size, bias=shape.proj_bias)
        self.conv1d = CausalConv1d(self.inner_size, self.kernel, bias=shape.conv_bias)
        self.x_proj = Linear(self.inner_size, self.dt_rank + 2 * self.state_size, bias=False)
        self.dt_proj = Linear(self.dt_rank, self.inner_size, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner_size, self.state_size), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.inner_size), requires_grad=False)
        self.out_proj = Linear(self.inner_size, cfg.hidden_size, bias=shape.proj_bias)
        if shape.dt_norms == WEIGHTED_NORMS:
            self.dt_layernorm = RMSNorm(self.dt_rank, shape.eps)
            self.b_layernorm = RMSNorm(self.state_size, shape.eps)
            self.c_layernorm = RMSNorm(self.state_size, shape.eps)
        elif shape.dt_norms == WEIGHTLESS_NORMS:
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = WeightlessRMSNorm(shape.eps)
        self.has_norms = shape.dt_norms != NO_NORMS
        self.dtype = cfg.dtype

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One slot's convolution state and SSM state."""
        return [((self.inner_size, self.kernel - 1), self.dtype), ((self.inner_size, self.state_size), torch.float32)]

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        conv_states, ssm_states = state
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        conv_out = torch.empty_like(x)
        for slot, start, length, fresh in ctx.state_prefill:
            rows = slice(start, start + length)
            # a new (or recomputed) sequence starts from zeros: the slot's old content is not read
            conv_state = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
            mixed, conv_states[slot] = (t[0] for t in causal_conv1d(x[rows].T[None], conv_state[None], weight, bias))
            conv_out[rows] = mixed.T
        num_prefill = ctx.num_prefill_tokens
        slots = ctx.state_decode_slots
        if num_prefill < hidden.shape[0]:
            mixed, conv_states[slots] = causal_conv1d(x[num_prefill:, :, None], conv_states[slots], weight, bias)
            conv_out[num_prefill:] = mixed.squeeze(-1)
        dt, B, C = self.x_proj(conv_out).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        if self.has_norms:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = placeless(F.softplus, self.dt_proj(dt).float(), self.dtype)
        A = -self.A_log.float().exp()
        fresh = [slot for slot, _, _, is_fresh in ctx.state_prefill if is_fresh]
        if fresh:  # a new (or recomputed) sequence starts from zeros
            ssm_states[fresh] = 0
        decoding = hidden.shape[0] - num_prefill
        slots = [slot for slot, *_ in ctx.state_prefill] + ([] if decoding == 0 else slots.tolist())
        lengths = [length for _, _, length, _ in ctx.state_prefill] + [1] * decoding
        out = mamba1_scan(conv_out.float().contiguous(), dt.contiguous(), A, B.float().contiguous(),
                          C.float().contiguous(), ssm_states, torch.tensor(slots), torch.tensor(lengths))
        out = (out + self.D.float() * conv_out.float()) * placeless(F.silu, z.float(), self.dtype)
        return self.out_proj(out.to(self.dtype))
