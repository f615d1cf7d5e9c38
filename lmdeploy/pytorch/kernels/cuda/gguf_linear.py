"""Triton GEMMs straight from GGUF Q6_K and Q8_0 weights: ``x @ W.T`` with each weight tile dequantized in
registers (fp32, then the activations' dtype, as dequantizing the layer would round it) and fp32 accumulation.
The weights are the file's bits, retiled once at load (``nn/quant/gguf_cuda.py``):

- Q6_K, 0.82 bytes a weight as in the file: per row and block of 256 inputs, ``ql`` 32 int32 words of low
  nibbles (word ``j``, field ``i``: input ``32 i + j``), ``qh`` 16 int32 words of top bit pairs (word ``j``,
  field ``r``: input ``16 r + j``), the 16 int8 scales ``sc`` and the fp16 ``d``; ``W = (u - 32) * d * sc``.
  So each run of 16 inputs (one scale) is a field of 16 consecutive words, shifted out without a reshape.
- Q8_0, 1.06 bytes a weight: the int8 codes ``[N, K]`` and an fp16 ``d`` per 32 inputs; ``W = q * d``.

Steps of a few rows (decode) split the inputs over programs (``SPLIT_K``) so that a layer of few outputs
still fills the GPU; their fp32 partial sums are added by torch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.cuda.utils import dot_precision

Q6K_BLOCK, Q8_0_BLOCK = 256, 32
SMALL_M = 16  # steps of up to this many rows take the decode launch
TARGET_PROGRAMS = 256  # about two per SM of an H100/H200: the decode launch splits K until it has as many


class GgufLaunch(NamedTuple):
    """Tiles of one launch: ``split_k`` programs share each output tile's inputs."""
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _q6k_gemm_kernel(x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, M, N, num_blocks, blocks_per_split,
                     stride_xm, stride_om, stride_os, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask, col_mask = rows < M, cols < N
    words = tl.arange(0, 16)
    cols64 = cols.to(tl.int64)
    ql_rows = ql_ptr + cols64[:, None] * (num_blocks * 32) + words[None, :]
    qh_rows = qh_ptr + cols64[:, None] * (num_blocks * 16) + words[None, :]
    sc_rows = sc_ptr + cols64 * (num_blocks * 16)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm + words[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * blocks_per_split
    for block in range(first, tl.minimum(first + blocks_per_split, num_blocks)):
        nibbles_even = tl.load(ql_rows + block * 32, mask=col_mask[:, None], other=0)  # the even runs' words
        nibbles_odd = tl.load(ql_rows + block * 32 + 16, mask=col_mask[:, None], other=0)
        top = tl.load(qh_rows + block * 16, mask=col_mask[:, None], other=0)
        d = tl.load(d_ptr + cols64 * num_blocks + block, mask=col_mask, other=0.0).to(tl.float32)
        for run in tl.static_range(16):
            nibbles = (nibbles_odd if run % 2 else nibbles_even) >> (4 * (run // 2))
            codes = (nibbles & 15) | (((top >> (2 * run)) & 3) << 4)
            scale = d * tl.load(sc_rows + block * 16 + run, mask=col_mask, other=0).to(tl.float32)
            x = tl.load(x_rows + block * 256 + run * 16, mask=row_mask[:, None], other=0.0)
            w = ((codes - 32).to(tl.float32) * scale[:, None]).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    tl.store(out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _q8_0_gemm_kernel(x_ptr, codes_ptr, d_ptr, out_ptr, M, N, K, steps_per_split, stride_xm, stride_om, stride_os,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask, col_mask = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    cols64 = cols.to(tl.int64)
    code_rows = codes_ptr + cols64[:, None] * K + ks[None, :]
    d_rows = d_ptr + cols64[:, None] * (K // 32) + (ks // 32)[None, :]
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, K // BLOCK_K)):
        k0 = step * BLOCK_K
        codes = tl.load(code_rows + k0, mask=col_mask[:, None], other=0)
        d = tl.load(d_rows + k0 // 32, mask=col_mask[:, None], other=0.0)  # one address per 32 inputs
        x = tl.load(x_rows + k0, mask=row_mask[:, None], other=0.0)
        w = (codes.to(tl.float32) * d.to(tl.float32)).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    tl.store(out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def gguf_launch(m: int, n: int, k_steps: int) -> GgufLaunch:
    """The tiles for ``M`` rows, ``N`` outputs and ``k_steps`` steps along the inputs (Q6_K blocks, Q8_0 tiles):
    up to ``SMALL_M`` rows one 16-row tile and the inputs split until about ``TARGET_PROGRAMS`` programs run;
    more rows tiles of up to 128 and no split."""
    if m <= SMALL_M:
        col_tiles = triton.cdiv(n, 64)
        split = min(k_steps, max(1, triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, col_tiles))))
        return GgufLaunch(16, 64, triton.cdiv(k_steps, triton.cdiv(k_steps, split)), 4, 2)
    if m <= 64:
        return GgufLaunch(triton.next_power_of_2(m), 64, 1, 4, 2)
    return GgufLaunch(128, 64, 1, 8, 2)


def _launch(kernel, x: torch.Tensor, n: int, k_steps: int, weights: tuple, extra: tuple,
            launch: GgufLaunch | None, **constexprs) -> torch.Tensor:
    """Runs ``kernel`` over ``x [M, K]`` into ``[M, N]`` (fp32 partial sums per split, then added)."""
    x = x.contiguous()
    m = x.shape[0]
    launch = launch or gguf_launch(m, n, k_steps)
    steps_per_split = triton.cdiv(k_steps, launch.split_k)
    split = triton.cdiv(k_steps, steps_per_split)
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split)
    kernel[grid](x, *weights, out, m, n, *extra, steps_per_split, x.stride(0), out.stride(1), out.stride(0),
                 PRECISION=dot_precision(x.dtype), BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                 num_warps=launch.num_warps, num_stages=launch.num_stages, **constexprs)
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


def q6k_linear(x: torch.Tensor, ql: torch.Tensor, qh: torch.Tensor, sc: torch.Tensor, d: torch.Tensor,
               launch: GgufLaunch | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` for Q6_K weights retiled as the module describes: ``ql int32 [N, K / 8]``, ``qh int32
    [N, K / 16]``, ``sc int8 [N, K / 16]``, ``d fp16 [N, K / 256]``; ``launch`` overrides the tiles."""
    n, num_blocks = d.shape
    if x.shape[1] != num_blocks * Q6K_BLOCK:
        raise ValueError(f'x has {x.shape[1]} inputs, the Q6_K weight {num_blocks * Q6K_BLOCK}')
    return _launch(_q6k_gemm_kernel, x, n, num_blocks, (ql, qh, sc, d), (num_blocks, ), launch)


def q8_0_block_k(k: int) -> int:
    """The inputs of one step of the Q8_0 GEMM: 128 where they divide ``K``, else 64 or 32 (Q8_0's block)."""
    return next(block_k for block_k in (128, 64, Q8_0_BLOCK) if k % block_k == 0)


def q8_0_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor,
                launch: GgufLaunch | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` for Q8_0 weights: int8 ``codes [N, K]`` and fp16 ``d [N, K / 32]``; ``launch`` overrides
    the tiles."""
    n, k = codes.shape
    if x.shape[1] != k or k % Q8_0_BLOCK:
        raise ValueError(f'x has {x.shape[1]} inputs, the Q8_0 weight {k} (a multiple of {Q8_0_BLOCK})')
    block_k = q8_0_block_k(k)
    return _launch(_q8_0_gemm_kernel, x, n, k // block_k, (codes, d), (k, ), launch, BLOCK_K=block_k)
