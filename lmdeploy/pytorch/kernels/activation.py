"""SiLU-and-mul: the gated activation of Llama-style MLPs."""
import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[..., 2 * I]`` holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
