"""Triton twin of ``kernels/gated_delta.py: gated_delta_decode``: one decode token of each sequence through the
gated delta rule, reading and writing its row of the state pool in place (no gather, no scatter)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.gated_delta import L2NORM_EPS


@triton.jit
def _gated_delta_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, out_ptr,
                               stride_qb, stride_qh, stride_vb, stride_vh, stride_gb, stride_gh, stride_gk,
                               stride_betab,
                               stride_ss, stride_sh, stride_sk, stride_ob, stride_oh,
                               heads_per_key_head, k_dim, v_dim, scale, eps,
                               BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program ``(b, h, j)``: value features ``j * BLOCK_V:`` of head ``h`` of sequence ``b``; the whole key
    dimension at once (``BLOCK_K >= k_dim``). The decay of key feature ``i`` is at ``g_ptr + b * stride_gb +
    h * stride_gh + i * stride_gk`` (``stride_gk`` 0: one a head)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows_k = tl.arange(0, BLOCK_K)
    mask_k, mask_v = rows_k < k_dim, cols_v < v_dim
    key_head = h // heads_per_key_head
    q = tl.load(q_ptr + b * stride_qb + key_head * stride_qh + rows_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_qb + key_head * stride_qh + rows_k, mask=mask_k, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + cols_v, mask=mask_v, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * stride_gb + h * stride_gh + rows_k * stride_gk, mask=mask_k,
                           other=0.0).to(tl.float32))
    beta = tl.load(beta_ptr + b * stride_betab + h).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    offsets = slot * stride_ss + h * stride_sh + rows_k[:, None] * stride_sk + cols_v[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(states_ptr + offsets, mask=mask, other=0.0) * decay[:, None]
    memory = tl.sum(state * k[:, None], axis=0)
    state += k[:, None] * ((v - memory) * beta)[None, :]
    tl.store(states_ptr + offsets, state, mask=mask)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + cols_v, out, mask=mask_v)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``q, k [B, Hk, Dk]``, ``v [B, H, Dv]``, ``g`` (``[B, H]``, or ``[B, H, Dk]`` per key feature: KDA),
    ``beta [B, H]``; sequence ``b`` updates row ``slots[b]`` of the fp32 ``states [slots, H, Dk, Dv]`` in place.
    Returns the fp32 output ``[B, H, Dv]``."""
    batch, num_heads, v_dim = v.shape
    k_dim = q.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta, slots = g.contiguous(), beta.contiguous(), slots.contiguous()
    out = torch.empty(batch, num_heads, v_dim, dtype=torch.float32, device=v.device)
    block_v = min(32, triton.next_power_of_2(v_dim))
    grid = (batch, num_heads, triton.cdiv(v_dim, block_v))
    stride_gk = g.stride(2) if g.dim() == 3 else 0
    _gated_delta_decode_kernel[grid](q, k, v, g, beta, states, slots, out, q.stride(0), q.stride(1), v.stride(0),
                                     v.stride(1), g.stride(0), g.stride(1), stride_gk, beta.stride(0),
                                     states.stride(0), states.stride(1), states.stride(2), out.stride(0),
                                     out.stride(1), num_heads // q.shape[1], k_dim, v_dim, k_dim**-0.5, L2NORM_EPS,
                                     BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v)
    return out
