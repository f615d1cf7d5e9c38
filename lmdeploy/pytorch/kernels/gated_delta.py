"""Gated DeltaNet (Qwen3-Next, Qwen3.5 linear attention) and Kimi Delta Attention (Kimi-Linear) in torch: the causal
depthwise convolution over a carried state, the chunked gated delta rule for prefill and its token-by-token
recurrence for decode. The decay ``g`` is one per head (``[..., H]``: Gated DeltaNet) or one per head and key feature
(``[..., H, Dk]``: KDA's per-channel forget gate). Both accumulate in fp32 and follow transformers' torch
implementations. :func:`gated_delta_decode` (the recurrence on
the rows of a state pool) has a Triton twin in ``kernels/cuda/gated_delta.py`` and a native CPU one (AVX-512) in
``kernels/cpu/gated_delta.cpp``, which also holds :func:`causal_conv1d_decode`'s; the rest is torch on every
device."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels.activation import placeless

L2NORM_EPS = 1e-6


DELTA_RULE_CHUNK = 64  # tokens the prefill's delta rule solves at once


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU (without ``silu``: none, LFM2's short convolutions) of the depthwise causal convolution of
    ``x [B, C, L]`` preceded by ``state [B, C, K - 1]`` (the previous ``K - 1`` inputs, zeros at the start), by
    ``weight [C, K]`` (plus ``bias [C]``: Mamba-2); returns ``[B, C, L]`` and the new state. The SiLU runs
    ``placeless`` (one sequence's bits whatever the batch holds)."""
    full = torch.cat((state.to(x.dtype), x), dim=-1)
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return placeless(F.silu, out) if silu else out, full[..., full.shape[-1] - state.shape[-1]:]


def causal_conv1d_decode(x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                         weight: torch.Tensor) -> torch.Tensor:
    """:func:`causal_conv1d` of one new input ``x [B, C]`` of each sequence after row ``slots[b]`` of the pool
    ``conv_states [slots, C, K - 1]``, which takes the new state in place; returns ``[B, C]``."""
    out, conv_states[slots] = causal_conv1d(x[..., None], conv_states[slots], weight)
    return out.squeeze(-1)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 queries and keys, L2-normed (queries also scaled by ``k_dim ** -0.5``), each key head repeated for
    the value heads it serves; heads on dim -2."""
    repeat = num_v_heads // q.shape[-2]
    q, k = (_l2norm(t.float()).repeat_interleave(repeat, dim=-2) for t in (q, k))
    return q * q.shape[-1]**-0.5, k


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | None,
                           chunk_size: int = DELTA_RULE_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: ``q, k [L, Hk, Dk]``, ``v [L, H, Dv]``, log decay ``g`` (``[L, H]``, or ``[L, H, Dk]``
    per key feature) and ``beta [L, H]``, from ``state [H, Dk, Dv]`` (None: zeros). Returns the fp32 output
    ``[L, H, Dv]`` and the fp32 state after the last token; within a chunk of ``chunk_size`` tokens the updates are
    solved as one triangular system (the UT transform), the chunks run in turn."""
    length, num_heads, v_dim = v.shape
    per_feature = g.dim() == 3
    q, k = _prepare(q, k, num_heads)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v.float()))  # [H, L, D]
    g = g.float().transpose(0, 1) if per_feature else g.float().T.unsqueeze(-1)  # [H, L, Dk or 1]
    beta = beta.float().T  # [H, L]
    pad = -length % chunk_size
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.unflatten(1, (-1, chunk_size)) for t in (q, k, k_beta, v_beta))  # [H, N, C, D]
    cum = g.unflatten(1, (-1, chunk_size)).cumsum(-2)  # [H, N, C, Dk or 1]
    system, intra = _decayed_products(q, k, k_beta, cum, per_feature)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp(), upper=False, unitriangular=True)
    q = q * cum.exp()
    k = k * (cum[..., -1:, :] - cum).exp()
    chunk_decay = cum[..., -1, :].exp().unsqueeze(-1)  # [H, N, Dk or 1, 1]
    state = (torch.zeros(num_heads, k.shape[-1], v_dim, dtype=torch.float32, device=v.device) if state is None
             else state.float())
    out = torch.empty_like(new_values)
    for i in range(new_values.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.flatten(1, 2)[:, :length].transpose(0, 1)
    return out, state


def _decayed_products(q: torch.Tensor, k: torch.Tensor, k_beta: torch.Tensor, cum: torch.Tensor,
                      per_feature: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Within each chunk (``[H, N, C, D]`` inputs, cumulative log decay ``cum [H, N, C, Dk or 1]``), the decayed
    products ``k_beta_i . k_j`` (the triangular system) and ``q_i . k_j`` for ``j <= i``, zeros above; a per-feature
    decay weighs each key feature by its own decay, one chunk at a time (``[H, C, C, Dk]`` at once)."""
    chunk_size = cum.shape[-2]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    if not per_feature:
        cum = cum.squeeze(-1)
        decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float('-inf')).exp()
        return (k_beta @ k.transpose(-1, -2)) * decay, (q @ k.transpose(-1, -2)) * decay
    system, intra = (torch.empty(*cum.shape[:-1], chunk_size, dtype=torch.float32, device=q.device) for _ in range(2))
    for i in range(cum.shape[1]):
        decay = (cum[:, i].unsqueeze(-2) - cum[:, i].unsqueeze(-3)).masked_fill(upper[..., None], float('-inf')).exp()
        keys = k[:, i].unsqueeze(-3) * decay  # [H, C (i), C (j), Dk]
        system[:, i] = (k_beta[:, i].unsqueeze(-2) * keys).sum(-1)
        intra[:, i] = (q[:, i].unsqueeze(-2) * keys).sum(-1)
    return system, intra


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of each of ``B`` sequences: ``q, k [B, Hk, Dk]``, ``v [B, H, Dv]``, ``g`` (``[B, H]``, or
    ``[B, H, Dk]`` per key feature), ``beta [B, H]``; sequence ``b`` reads and updates row ``slots[b]`` of the fp32
    state pool ``states [slots, H, Dk, Dv]``. Returns the fp32 output ``[B, H, Dv]``."""
    q, k = _prepare(q, k, v.shape[-2])
    state = states[slots]  # a copy: updated in place, then written back
    state.mul_(g.float().exp()[..., None] if g.dim() == 3 else g.float().exp()[..., None, None])
    memory = (k.unsqueeze(-2) @ state).squeeze(-2)
    delta = (v.float() - memory) * beta.float().unsqueeze(-1)
    k_dim, v_dim = state.shape[-2:]
    state.view(-1, k_dim, v_dim).baddbmm_(k.reshape(-1, k_dim, 1), delta.reshape(-1, 1, v_dim))
    states[slots] = state
    return (q.unsqueeze(-2) @ state).squeeze(-2)
