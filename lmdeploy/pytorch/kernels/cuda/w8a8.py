"""Triton W8A8 linear: activations quantized per token (one program per row), then an int8 GEMM with int32
accumulators whose epilogue applies the token and channel scales and the bias. Mirrors
``kernels/w8a8.py``'s ``w8a8_linear``, rounding included."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_half_even(v):
    r = tl.floor(v + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - v) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    peak = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * K + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    amax = tl.max(peak, axis=0)
    inv = tl.where(amax > 0.0, tl.math.div_rn(127.0, tl.maximum(amax, 1e-30)), 0.0)  # IEEE division, as torch
    tl.store(scale_ptr + row, amax / 127.0)
    for k in range(0, K, BLOCK_K):
        mask = k + cols < K
        x = tl.load(x_ptr + row * K + k + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(_round_half_even(x * inv), -127.0), 127.0)
        tl.store(q_ptr + row * K + k + cols, q.to(tl.int8), mask=mask)


@triton.jit
def _int8_gemm_kernel(q_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k in range(0, K, BLOCK_K):
        kmask = k + ks < K
        a = tl.load(q_ptr + rows[:, None].to(tl.int64) * K + (k + ks)[None, :],
                    mask=(rows[:, None] < M) & kmask[None, :], other=0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + (k + ks)[:, None],
                    mask=(cols[None, :] < N) & kmask[:, None], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in ``x.dtype``, ``W = weight * scale`` (int8 ``[N, K]``, fp32 ``[N, 1]``), ``x``
    quantized per token."""
    shape = x.shape
    N, K = weight.shape
    rows = x.reshape(-1, K).contiguous()
    M = rows.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    x_scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(M,)](rows, q, x_scale, K, BLOCK_K=min(1024, triton.next_power_of_2(K)))
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m = max(16, min(64, triton.next_power_of_2(M)))
    block_n, block_k = 64, 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    w_scale = scale.reshape(-1).float().contiguous()
    _int8_gemm_kernel[grid](q, x_scale, weight.contiguous(), w_scale, bias if bias is not None else w_scale, out,
                            M, N, K, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(*shape[:-1], N)
