"""The gated activations of MLPs: SiLU-and-mul (Llama), GeLU(tanh)-and-mul (Gemma) and the clamped SwiGLU of
gpt-oss experts."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


def placeless(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``op(x)`` (an element-wise op) whose elements' bits do not depend on their place in ``x`` where ``dtype``
    (``x``'s by default; the model's where ``x`` was widened) is fp32: ``op`` then runs in fp64, rounded to fp32.
    torch's fp32 transcendental ops (exp and what builds on it) take a tensor's last elements, after its whole
    vectors, and each thread's share's, on a scalar path a bit apart from the vector one, so a row's values
    depended on its place among the step's rows; the two fp64 paths differ by at most an fp64 ulp, which moves the
    fp32 rounding only within that ulp of a boundary (invariant in practice, not by construction). Other dtypes:
    ``op(x)``."""
    if (dtype or x.dtype) == torch.float32:
        return op(x.double()).float()
    return op(x)


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

    The sigmoid runs :func:`placeless`."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    scaled = gate * act.alpha
    return (up + 1) * (gate * placeless(torch.sigmoid, scaled))
