"""Triton kernels for the row-wise ops: RMSNorm (+ residual), rotary embedding, SiLU-and-mul and the
clamped SwiGLU."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(norm(x + residual), x + residual)`` over the last dimension."""
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    out = torch.empty_like(x2)
    res2 = summed = x2
    if residual is not None:
        res2 = residual.reshape(-1, n_cols).contiguous()
        summed = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, res2, weight, out, summed, n_cols, eps, HAS_RES=residual is not None,
                                     BLOCK=triton.next_power_of_2(n_cols))
    return out.view(x.shape), (x if residual is None else summed.view(x.shape))


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, half,
                   stride_xt, stride_xh, stride_ct, stride_st,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    mask = (heads[:, None] < num_heads) & dmask[None, :]
    cos1 = tl.load(cos_ptr + tok * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + tok * stride_ct + half + d, mask=dmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + tok * stride_st + d, mask=dmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + tok * stride_st + half + d, mask=dmask, other=0.0).to(tl.float32)
    base = x_ptr + tok * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    obase = out_ptr + (tok * num_heads + heads[:, None]) * (2 * half) + d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(obase, (x1 * cos1[None, :] - x2 * sin1[None, :]).to(ty), mask=mask)
    tl.store(obase + half, (x2 * cos2[None, :] + x1 * sin2[None, :]).to(ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [T, H, D]`` (last dim contiguous) by ``cos, sin [T, D]``; neox layout."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_h = min(triton.next_power_of_2(num_heads), 16)
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _rotary_kernel[grid](x, cos, sin, out, num_heads, head_dim // 2, x.stride(0), x.stride(1), cos.stride(0),
                         sin.stride(0), BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(head_dim // 2))
    return out


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, inter, stride_x, alpha, limit, CLAMPED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gated_act(gate_up: torch.Tensor, out: torch.Tensor | None, act: ClampedSwiGLU | None) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(inter), 1024)
    alpha, limit = act if act is not None else (1.0, 0.0)
    _gated_act_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, inter, x2.stride(0), alpha, limit,
                                                                CLAMPED=act is not None, BLOCK=block)
    return out


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2 * I]`` (gate then up); writes ``out`` when given."""
    return _gated_act(gate_up, out, None)


def clamped_swiglu(gate_up: torch.Tensor, act: ClampedSwiGLU, out: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`ClampedSwiGLU` of ``gate_up [..., 2 * I]`` (gate then up); writes ``out`` when given."""
    return _gated_act(gate_up, out, act)
