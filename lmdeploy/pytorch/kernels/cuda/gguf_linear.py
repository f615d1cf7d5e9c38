"""Triton GEMMs straight from GGUF Q6_K and Q8_0 weights: ``x @ W.T`` with each weight tile dequantized in
registers (fp32, then the activations' dtype, as dequantizing the layer would round it) and fp32 accumulation.
The weights are the file's bits, retiled once at load (``nn/quant/gguf_cuda.py``):

- Q6_K, 0.82 bytes a weight as in the file: per row and block of 256 inputs, ``ql`` 32 int32 words of low
  nibbles (word ``j``, field ``i``: input ``32 i + j``), ``qh`` 16 int32 words of top bit pairs (word ``j``,
  field ``r``: input ``16 r + j``), the 16 int8 scales ``sc`` and the fp16 ``d``; ``W = (u - 32) * d * sc``.
  So each run of 16 inputs (one scale) is a field of 16 consecutive words, shifted out without a reshape.
- Q8_0, 1.06 bytes a weight: the int8 codes ``[N, K]`` and an fp16 ``d`` per 32 inputs; ``W = q * d``.

Steps of a few rows (decode) split the inputs over programs (``SPLIT_K``) so that a layer of few outputs
still fills the GPU; their fp32 partial sums are added by torch. With ``GROUPED`` the same kernels are the fused
MoE's grouped GEMM over experts' weights stacked ``[E, N, ...]`` (:func:`gguf_grouped_gemm`).
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
def _tile_rows(slots_ptr, block_expert_ptr, M, a_row_div, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's rows of ``x`` and of the output, their mask and its expert: in a grouped GEMM its M-block's slots
    (all routed to one expert; ``x``'s row ``slot // a_row_div``), else rows ``m * BLOCK_M + i`` and expert 0."""
    if GROUPED:
        slots = tl.load(slots_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        return slots // a_row_div, slots, slots < M, tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return rows, rows, rows < M, tl.program_id(0).to(tl.int64) * 0


@triton.jit
def _store_tile(acc, out_ptr, out_rows, row_mask, cols, col_mask, expert, topk_w_ptr, bias_ptr, stride_om, stride_os,
                stride_be, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``acc`` (plus the expert's bias, then times each slot's routing weight, where asked) into the output rows
    of split ``program_id(2)``."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + out_rows, mask=row_mask, other=0.0)[:, None]
    tl.store(out_ptr + tl.program_id(2) * stride_os + out_rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _q6k_gemm_kernel(x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, slots_ptr, block_expert_ptr, topk_w_ptr, bias_ptr,
                     M, N, num_blocks, num_experts, a_row_div, blocks_per_split, stride_xm, stride_om, stride_os,
                     stride_be, GROUPED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    x_rows, out_rows, row_mask, expert = _tile_rows(slots_ptr, block_expert_ptr, M, a_row_div, GROUPED, BLOCK_M)
    if expert >= num_experts:  # a grouped GEMM's unused tail block
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    words = tl.arange(0, 16)
    weight_rows = expert * N + cols.to(tl.int64)  # the expert's rows of [E * N, ...] weights
    ql_rows = ql_ptr + weight_rows[:, None] * (num_blocks * 32) + words[None, :]
    qh_rows = qh_ptr + weight_rows[:, None] * (num_blocks * 16) + words[None, :]
    sc_rows = sc_ptr + weight_rows * (num_blocks * 16)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + words[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * blocks_per_split
    for block in range(first, tl.minimum(first + blocks_per_split, num_blocks)):
        nibbles_even = tl.load(ql_rows + block * 32, mask=col_mask[:, None], other=0)  # the even runs' words
        nibbles_odd = tl.load(ql_rows + block * 32 + 16, mask=col_mask[:, None], other=0)
        top = tl.load(qh_rows + block * 16, mask=col_mask[:, None], other=0)
        d = tl.load(d_ptr + weight_rows * num_blocks + block, mask=col_mask, other=0.0).to(tl.float32)
        for run in tl.static_range(16):
            nibbles = (nibbles_odd if run % 2 else nibbles_even) >> (4 * (run // 2))
            codes = (nibbles & 15) | (((top >> (2 * run)) & 3) << 4)
            scale = d * tl.load(sc_rows + block * 16 + run, mask=col_mask, other=0).to(tl.float32)
            x = tl.load(x_ptrs + block * 256 + run * 16, mask=row_mask[:, None], other=0.0)
            w = ((codes - 32).to(tl.float32) * scale[:, None]).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    _store_tile(acc, out_ptr, out_rows, row_mask, cols, col_mask, expert, topk_w_ptr, bias_ptr, stride_om, stride_os,
                stride_be, MUL_WEIGHT, HAS_BIAS)


@triton.jit
def _q8_0_gemm_kernel(x_ptr, codes_ptr, d_ptr, out_ptr, slots_ptr, block_expert_ptr, topk_w_ptr, bias_ptr, M, N, K,
                      num_experts, a_row_div, steps_per_split, stride_xm, stride_om, stride_os, stride_be,
                      GROUPED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    x_rows, out_rows, row_mask, expert = _tile_rows(slots_ptr, block_expert_ptr, M, a_row_div, GROUPED, BLOCK_M)
    if expert >= num_experts:  # a grouped GEMM's unused tail block
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    weight_rows = expert * N + cols.to(tl.int64)
    code_rows = codes_ptr + weight_rows[:, None] * K + ks[None, :]
    d_rows = d_ptr + weight_rows[:, None] * (K // 32) + (ks // 32)[None, :]
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, K // BLOCK_K)):
        k0 = step * BLOCK_K
        codes = tl.load(code_rows + k0, mask=col_mask[:, None], other=0)
        d = tl.load(d_rows + k0 // 32, mask=col_mask[:, None], other=0.0)  # one address per 32 inputs
        x = tl.load(x_ptrs + k0, mask=row_mask[:, None], other=0.0)
        w = (codes.to(tl.float32) * d.to(tl.float32)).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    _store_tile(acc, out_ptr, out_rows, row_mask, cols, col_mask, expert, topk_w_ptr, bias_ptr, stride_om, stride_os,
                stride_be, MUL_WEIGHT, HAS_BIAS)


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


def _launch(kernel, x: torch.Tensor, n: int, k_steps: int, weights: tuple, k_arg: int,
            launch: GgufLaunch | None, **constexprs) -> torch.Tensor:
    """Runs ``kernel`` over ``x [M, K]`` into ``[M, N]`` (fp32 partial sums per split, then added)."""
    x = x.contiguous()
    m = x.shape[0]
    launch = launch or gguf_launch(m, n, k_steps)
    steps_per_split = triton.cdiv(k_steps, launch.split_k)
    split = triton.cdiv(k_steps, steps_per_split)
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split)
    kernel[grid](x, *weights, out, None, None, None, None, m, n, k_arg, 1, 1, steps_per_split, x.stride(0),
                 out.stride(1), out.stride(0), 0, GROUPED=False, MUL_WEIGHT=False, HAS_BIAS=False,
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
    return _launch(_q6k_gemm_kernel, x, n, num_blocks, (ql, qh, sc, d), num_blocks, launch)


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
    return _launch(_q8_0_gemm_kernel, x, n, k // block_k, (codes, d), k, launch, BLOCK_K=block_k)


class Q6KExperts(NamedTuple):
    """Experts' Q6_K weights, each expert's retiled as :func:`q6k_linear` reads them: ``ql int32 [E, N, K / 8]``,
    ``qh int32 [E, N, K / 16]``, ``sc int8 [E, N, K / 16]``, ``d fp16 [E, N, K / 256]``."""

    ql: torch.Tensor
    qh: torch.Tensor
    sc: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)``, as a dense ``[E, N, K]`` weight's."""
        num_experts, n, num_blocks = self.d.shape
        return num_experts, n, num_blocks * Q6K_BLOCK


class Q8Experts(NamedTuple):
    """Experts' Q8_0 weights: int8 ``codes [E, N, K]`` and fp16 ``d [E, N, K / 32]``."""

    codes: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.codes.shape)


def gguf_grouped_gemm(a: torch.Tensor, w: Q6KExperts | Q8Experts, c: torch.Tensor, sorted_slots: torch.Tensor,
                      block_expert: torch.Tensor, topk_weights: torch.Tensor | None, bias: torch.Tensor | None,
                      a_row_div: int, block_m: int, num_warps: int) -> None:
    """The fused MoE's grouped GEMM (``fused_moe._grouped_gemm``) on GGUF experts: ``c[slot] = a[slot // a_row_div]
    @ w[expert(slot)].T``, plus the expert's ``bias [E, N]`` and times the slot's weight where given; ``block_m``
    the M-blocks ``align_by_expert`` padded the slots to."""
    num_experts, n, k = w.shape
    q6k = isinstance(w, Q6KExperts)
    k_arg, constexprs = (k // Q6K_BLOCK, {}) if q6k else (k, {'BLOCK_K': q8_0_block_k(k)})
    grid = (block_expert.shape[0], triton.cdiv(n, 64), 1)
    (_q6k_gemm_kernel if q6k else _q8_0_gemm_kernel)[grid](
        a, *w, c, sorted_slots, block_expert, topk_weights, bias, c.shape[0], n, k_arg, num_experts, a_row_div,
        k_arg if q6k else k // constexprs['BLOCK_K'], a.stride(0), c.stride(0), 0,
        0 if bias is None else bias.stride(0), GROUPED=True, MUL_WEIGHT=topk_weights is not None,
        HAS_BIAS=bias is not None, PRECISION=dot_precision(a.dtype), BLOCK_M=block_m, BLOCK_N=64,
        num_warps=num_warps, num_stages=2, **constexprs)
