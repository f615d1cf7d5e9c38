"""Triton W4A16 GEMM: ``x @ W.T`` with ``W`` as 4-bit codes in groups of inputs, dequantized in registers
tile by tile (the codes are read from memory as they are, eight per int32)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_kernel(x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, M, N, K, group_size,
                  stride_xm, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        wmask = k_mask[:, None] & col_mask[None, :]
        packed = tl.load(qweight_ptr + (ks[:, None] // 8).to(tl.int64) * N + cols[None, :], mask=wmask, other=0)
        codes = (packed >> ((ks[:, None] % 8) * 4)) & 0xF
        group = (ks[:, None] // group_size).to(tl.int64) * N + cols[None, :]
        scale = tl.load(scales_ptr + group, mask=wmask, other=0.0).to(tl.float32)
        offset = tl.load(offsets_ptr + group, mask=wmask, other=0.0)
        w = codes.to(tl.float32) * scale - offset
        acc += tl.dot(x, w.to(x.dtype))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``W[n, k] = q[n, k] * scales[k // G, n] - offsets[k // G, n]`` (offsets fp32),
    with the codes ``q`` packed eight inputs per int32 (lowest field first) in ``qweight [K / 8, N]``."""
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = min(max(triton.next_power_of_2(m), 16), 64)
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](x, qweight, scales, offsets, out, m, n, k, group_size, x.stride(0), out.stride(0),
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
