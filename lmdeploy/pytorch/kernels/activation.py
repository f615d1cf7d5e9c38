"""The gated activations of MLPs: SiLU-and-mul (Llama), GeLU(tanh)-and-mul (Gemma)."""
import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[..., 2 * I]`` holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` where ``gate_up`` is ``[..., 2 * I]`` holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate='tanh') * up
