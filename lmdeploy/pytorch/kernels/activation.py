"""The gated activations of MLPs: SiLU-and-mul (Llama), GeLU(tanh)-and-mul (Gemma) and the clamped SwiGLU of
gpt-oss experts."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class ClampedSwiGLU(NamedTuple):
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)`` (gpt-oss)."""
    alpha: float = 1.702
    limit: float = 7.0


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[..., 2 * I]`` holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` where ``gate_up`` is ``[..., 2 * I]`` holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate='tanh') * up


def clamped_swiglu(gate_up: torch.Tensor, act: ClampedSwiGLU) -> torch.Tensor:
    """:class:`ClampedSwiGLU` of ``gate_up [..., 2 * I]`` holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))
