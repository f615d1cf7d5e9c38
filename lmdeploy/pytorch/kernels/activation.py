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
    """:class:`ClampedSwiGLU` of ``gate_up [..., 2 * I]`` holding gate then up.

    In fp32 the sigmoid runs in fp64: torch's fp32 sigmoid takes a tensor's last elements (after its whole vectors)
    on a scalar exp a bit apart from the vector one, so a row's activations depended on its place among the rows."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    scaled = gate * act.alpha
    sigmoid = scaled.double().sigmoid().float() if scaled.dtype == torch.float32 else torch.sigmoid(scaled)
    return (up + 1) * (gate * sigmoid)
