"""Mamba-2's selective state space (SSD) in torch, over a recurrent state per sequence: the chunked scan for
prefill and the one-token recurrence for decode, both in fp32, after transformers' torch implementation
(``mamba2_chunk_scan``, ``mamba2_selective_state_update``). Per head ``h`` (reading B/C group
``h // (heads / groups)``), from the state ``S [head_dim, d_state]``::

    S = exp(dt * A) * S + dt * x B^T        y = S C        (the ``D * x`` skip is the caller's)

Torch ops only: the same code runs on CUDA. The scan solves chunks of ``SSD_CHUNK`` tokens as masked matrix
products and carries the state from chunk to chunk in turn, so a prompt split on a multiple of the chunk gives the
bits of one call (the scheduler cuts recurrent models' prefill chunks there, see ``Scheduler.recurrent_grain``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels.activation import placeless

SSD_CHUNK = 64  # tokens the prefill's scan solves at once


def _per_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[..., G, N]`` B or C in fp32, each group repeated for the heads it serves: ``[..., H, N]``."""
    return t.float().repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor | None, chunk_size: int = SSD_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: ``x [L, H, P]``, time steps ``dt [L, H]`` (after softplus), ``A [H]`` (negative),
    ``B, C [L, G, N]``, from ``state [H, P, N]`` (None: zeros). Returns the fp32 output ``[L, H, P]`` and the fp32
    state after the last token."""
    length, num_heads, head_dim = x.shape
    pad = -length % chunk_size
    xdt = F.pad(x.float() * dt.float().unsqueeze(-1), (0, 0, 0, 0, 0, pad))
    B, C = (F.pad(_per_head(t, num_heads), (0, 0, 0, 0, 0, pad)) for t in (B, C))
    log_decay = F.pad(dt.float() * A.float(), (0, 0, 0, pad))  # padded tokens neither decay nor add
    xdt, B, C = (t.unflatten(0, (-1, chunk_size)).transpose(1, 2).transpose(0, 1) for t in (xdt, B, C))  # [H, N, C, D]
    cum = log_decay.unflatten(0, (-1, chunk_size)).permute(2, 0, 1).cumsum(-1)  # [H, N, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float('-inf')).exp()
    intra = ((C @ B.transpose(-1, -2)) * decay) @ xdt  # [H, N, C, P]
    chunk_states = xdt.transpose(-1, -2) @ (B * (cum[..., -1:] - cum).exp().unsqueeze(-1))  # [H, N, P, N_state]
    C_decayed = C * cum.exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = (torch.zeros(num_heads, head_dim, B.shape[-1], dtype=torch.float32, device=x.device) if state is None
             else state.float())
    out = torch.empty_like(intra)
    for i in range(intra.shape[1]):
        out[:, i] = intra[:, i] + C_decayed[:, i] @ state.transpose(-1, -2)
        state = state * chunk_decay[:, i] + chunk_states[:, i]
    return out.flatten(1, 2)[:, :length].transpose(0, 1), state


def ssd_decode(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of each of ``S`` sequences: ``x [S, H, P]``, ``dt [S, H]``, ``B, C [S, G, N]``; sequence ``s``
    reads and updates row ``slots[s]`` of the fp32 state pool ``states [slots, H, P, N]``. Returns the fp32 output
    ``[S, H, P]`` (each sequence's bits whatever the others: the decay's ``exp`` runs ``placeless``)."""
    num_heads = x.shape[1]
    dt = dt.float()
    state = states[slots] * placeless(torch.exp, dt * A.float())[..., None, None]
    state += (x.float() * dt.unsqueeze(-1)).unsqueeze(-1) * _per_head(B, num_heads).unsqueeze(-2)
    states[slots] = state
    return (state @ _per_head(C, num_heads).unsqueeze(-1)).squeeze(-1)

