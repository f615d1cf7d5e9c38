"""Mamba-1's selective scan in torch, over a recurrent state per sequence, in fp32, after transformers' torch
implementation (``mamba_selective_scan``, ``mamba_selective_state_update``). Each of the ``D`` inner channels keeps a
state ``S [D, N]`` with its own ``A [D, N]`` (negative)::

    S = exp(dt * A) * S + (dt * x) B^T        y = S C        (the ``D * x`` skip and the gate are the caller's)

Unlike Mamba-2's scalar decay per head, the decay differs per state feature, so the scan runs token by token (the
discretization of ``SCAN_CHUNK`` tokens at once); prefill and decode take the same element-wise steps, so a token's
bits do not depend on where a prefill chunk ends nor on whether it was prefilled or decoded. :func:`mamba1_scan`, a
step's sequences at once, is the torch twin of the native ``mamba1_scan`` (``kernels/cpu/mamba1.cpp``, AVX-512: the
same steps in fp32, its ``exp`` within about an ulp of this one's), which the engine runs on such CPUs; these torch
ops run elsewhere (CUDA included)."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels.activation import placeless

SCAN_CHUNK = 64  # tokens discretized at once (bounds the ``[chunk, D, N]`` temporaries)


def _discretize(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(dt * A)`` and ``(dt * x) B^T``, ``[..., D, N]``, of ``x, dt [..., D]`` and ``B [..., N]`` (fp32; the
    ``exp`` runs ``placeless``)."""
    decay = placeless(torch.exp, dt.unsqueeze(-1) * A)
    return decay, (dt * x).unsqueeze(-1) * B.unsqueeze(-2)


def _read(states: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """``S C`` of states ``[..., D, N]`` and ``C [..., N]``: ``[..., D]``."""
    return (states * C.unsqueeze(-2)).sum(-1)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor | None, chunk_size: int = SCAN_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: ``x, dt [L, D]`` (dt after its softplus), ``A [D, N]``, ``B, C [L, N]``, from
    ``state [D, N]`` (None: zeros). Returns the fp32 output ``[L, D]`` and the fp32 state after the last token."""
    x, dt, B, C = (t.float() for t in (x, dt, B, C))
    state = torch.zeros(A.shape, dtype=torch.float32, device=x.device) if state is None else state.float()
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        decay, inputs = _discretize(x[rows], dt[rows], A, B[rows])
        for t in range(decay.shape[0]):
            state = decay[t] * state + inputs[t]
            inputs[t] = state  # the states, read by C below
        out[rows] = _read(inputs, C[rows])
    return out, state


def selective_decode(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of each of ``S`` sequences: ``x, dt [S, D]``, ``B, C [S, N]``; sequence ``s`` reads and updates
    row ``slots[s]`` of the fp32 state pool ``states [slots, D, N]``. Returns the fp32 output ``[S, D]``."""
    decay, inputs = _discretize(x.float(), dt.float(), A, B.float())
    state = decay * states[slots] + inputs
    states[slots] = state
    return _read(state, C.float())



def mamba1_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                states: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A step's sequences: sequence ``s`` is the next ``lengths[s]`` rows of ``x, dt [T, D]``, ``B, C [T, N]`` and
    steps row ``slots[s]`` of the fp32 state pool ``states [slots, D, N]`` in place (one-token sequences together,
    by :func:`selective_decode`; the others by :func:`selective_scan`). Returns the fp32 output ``[T, D]``."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bounds = [0, *torch.cumsum(lengths, 0).tolist()]
    if bounds[-1] != x.shape[0]:
        raise ValueError(f'the sequences\' lengths add up to {bounds[-1]}, not to the {x.shape[0]} rows')
    singles = [i for i, length in enumerate(lengths.tolist()) if length == 1]
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end - start > 1:
            slot = int(slots[i])
            out[start:end], states[slot] = selective_scan(x[start:end], dt[start:end], A, B[start:end],
                                                          C[start:end], states[slot])
    if singles:
        rows = torch.tensor([bounds[i] for i in singles], device=x.device)
        out[rows] = selective_decode(x[rows], dt[rows], A, B[rows], C[rows], states, slots[singles])
    return out
