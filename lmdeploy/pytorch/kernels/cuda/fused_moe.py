"""Fused MoE in Triton: softmax top-k routing, tokens sorted by expert, grouped GEMMs, weighted combine.

Routed slots ``(token, j)`` are flattened to ``token * top_k + j``, sorted by expert and padded so
that every ``BLOCK_M`` rows belong to one expert; padding rows hold the sentinel ``T * top_k``.
Nothing here synchronizes with the host, and every launch grid depends only on shapes (worst-case
capacity), so MoE steps can be captured in CUDA graphs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.kernels.cuda.elementwise import clamped_swiglu, silu_and_mul
from lmdeploy.pytorch.kernels.cuda.gguf_linear import Q6KExperts, Q8Experts, gguf_grouped_gemm
from lmdeploy.pytorch.kernels.cuda.utils import dot_precision


class MoEConfig(NamedTuple):
    """Tiles of both grouped GEMMs; ``group_m`` M-blocks walk all N-blocks before the next group."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (average routed slots per expert at most, config); the last row takes every larger shape. Up to a few
# slots per expert the GEMMs stream each active expert's weights once (narrow tiles, many programs); from
# about 48 on, BLOCK_M 128 gives most experts a single M-block, so their weights are read once.
# Priors: vLLM's tuned H200 configs for 128 experts and intermediate 768 at 1, 64, 512 and 1024+ tokens.
MOE_CONFIGS = (
    (1.0, MoEConfig(16, 64, 128, 1, 4, 4)),
    (8.0, MoEConfig(16, 128, 128, 1, 4, 2)),
    (48.0, MoEConfig(64, 128, 64, 1, 4, 3)),
    (float('inf'), MoEConfig(128, 256, 64, 16, 8, 4)),
)
_SLOTS_PER_PROGRAM = 1024
# 4-bit weights stage int32 codes per weight (and fp32 offsets) in shared memory: the last row's 256 columns
# needed 291 KB at 4 stages (the sm_90 limit is 227 KB), 128 columns need 178 KB and spill no registers.
_INT4_MAX_BLOCK_N = 128


@triton.jit
def _routing_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + tok * stride_t + e, mask=e < num_experts, other=float('-inf')).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < num_experts, p, -1.0)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        tl.store(weights_ptr + tok * TOP_K + j, best)
        tl.store(ids_ptr + tok * TOP_K + j, idx)
        total += best
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        for j in tl.static_range(TOP_K):
            tl.store(weights_ptr + tok * TOP_K + j, tl.load(weights_ptr + tok * TOP_K + j) / total)


def moe_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then the ``top_k`` largest: ``(weights [T, k] fp32, ids [T, k] int32)``."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    _routing_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                   RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts))
    return weights, ids


@triton.jit(do_not_specialize=['num_slots'])
def _count_experts_kernel(ids_ptr, counts_ptr, num_slots, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_slots
    tl.atomic_add(counts_ptr + tl.load(ids_ptr + offs, mask=mask, other=0), 1, mask=mask)


@triton.jit(do_not_specialize=['num_blocks'])
def _expert_blocks_kernel(counts_ptr, cursor_ptr, block_expert_ptr, num_experts, num_blocks, BLOCK_M: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    emask = e < num_experts
    padded = (tl.load(counts_ptr + e, mask=emask, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + e, end - padded, mask=emask)
    for j0 in range(0, num_blocks, BLOCK_B):
        j = j0 + tl.arange(0, BLOCK_B)
        done = (end[None, :] <= (j * BLOCK_M)[:, None]) & emask[None, :]
        tl.store(block_expert_ptr + j, tl.sum(done.to(tl.int32), axis=1), mask=j < num_blocks)


@triton.jit(do_not_specialize=['num_slots'])
def _scatter_slots_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_slots, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_slots
    row = tl.atomic_add(cursor_ptr + tl.load(ids_ptr + offs, mask=mask, other=0), 1, mask=mask)
    tl.store(sorted_ptr + row, offs, mask=mask)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_slots [P], block_expert [P // block_m])``: slots grouped by expert (in no fixed order
    within an expert), each group padded to ``block_m`` with the sentinel ``T * k``; ``P`` is the
    worst case for the shape, unused blocks get expert ``num_experts``."""
    flat = topk_ids.reshape(-1).contiguous()
    num_slots = flat.numel()
    capacity = triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    cursor = torch.empty_like(counts)  # each expert's next free row
    sorted_slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device)
    grid = (triton.cdiv(num_slots, _SLOTS_PER_PROGRAM),)
    _count_experts_kernel[grid](flat, counts, num_slots, BLOCK=_SLOTS_PER_PROGRAM)
    _expert_blocks_kernel[(1,)](counts, cursor, block_expert, num_experts, block_expert.shape[0], BLOCK_M=block_m,
                                BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=64)
    _scatter_slots_kernel[grid](flat, cursor, sorted_slots, num_slots, BLOCK=_SLOTS_PER_PROGRAM)
    return sorted_slots, block_expert


class Int4Experts(NamedTuple):
    """Experts' 4-bit weights ``W[e, n, k] = q[e, n, k] * scales[e, g, n] - offsets[e, g, n]`` with the group
    ``g = k // group_size``, or ``g_idx[e, k]`` (int32 ``[E, K]``; act-order GPTQ): the codes packed eight
    inputs per int32 (lowest field first) in ``qweight [E, K / 8, N]``, ``scales`` (a float dtype) and fp32
    ``offsets`` ``[E, K / G, N]``. The GEMM dequantizes each weight tile in registers."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    g_idx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)``, as a dense ``[E, N, K]`` weight's."""
        num_experts, packed_k, n = self.qweight.shape
        return num_experts, n, packed_k * 8


class Mxfp4Experts(NamedTuple):
    """Experts' MXFP4 weights: ``blocks [E, N, K / 32, 16]`` uint8 (byte ``j`` of a block holds the e2m1 codes of
    inputs ``2j``, low nibble, and ``2j + 1``) and ``scales [E, N, K / 32]`` uint8 (e8m0: ``2 ** (s - 127)``).
    The GEMM dequantizes each weight tile in registers."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)``, as a dense ``[E, N, K]`` weight's."""
        num_experts, n, groups, _ = self.blocks.shape
        return num_experts, n, groups * 32


@triton.jit
def _e2m1_value(codes):
    """The FP4 e2m1 value of each code (0-15): sign, two exponent bits, one mantissa bit."""
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit(do_not_specialize=['num_slots', 'num_mblocks'])
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, slots_ptr, block_expert_ptr, topk_w_ptr, bias_ptr, scales_ptr,
                         offsets_ptr, gidx_ptr, num_slots, num_mblocks, n, k, num_experts, a_row_div, group_size,
                         stride_am, stride_we, stride_wn, stride_cm, stride_be, stride_se, MUL_WEIGHT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_GIDX: tl.constexpr,
                         ONE_GROUP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(n, BLOCK_N)
    first_m = pid // per_group * GROUP_M
    group_size_m = tl.minimum(num_mblocks - first_m, GROUP_M)
    mblock = first_m + pid % per_group % group_size_m
    nblock = pid % per_group // group_size_m
    expert = tl.load(block_expert_ptr + mblock).to(tl.int64)
    if expert >= num_experts:
        return
    slots = tl.load(slots_ptr + mblock * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    smask = slots < num_slots
    cols = nblock * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (slots // a_row_div)[:, None] * stride_am + kk[None, :]
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn + kk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kmask = (k0 + kk) < k
        if EVEN_K:
            a = tl.load(a_rows + k0, mask=smask[:, None], other=0.0)
        else:
            a = tl.load(a_rows + k0, mask=smask[:, None] & kmask[None, :], other=0.0)
        if INT4:
            ks = k0 + kk
            wmask = kmask[:, None] & cmask[None, :]
            packed = tl.load(w_ptr + expert * stride_we + (ks[:, None] // 8) * n + cols[None, :], mask=wmask,
                             other=0)
            codes = (packed >> ((ks[:, None] % 8) * 4)) & 0xF
            if ONE_GROUP:  # the tile's inputs share one group: a row of scales and offsets
                group_index = expert * stride_se + k0 // group_size * n + cols[None, :]
                gmask = cmask[None, :]
            else:
                if HAS_GIDX:
                    groups = tl.load(gidx_ptr + expert * k + ks, mask=kmask, other=0)
                else:
                    groups = ks // group_size
                group_index = expert * stride_se + groups[:, None] * n + cols[None, :]
                gmask = wmask
            scale = tl.load(scales_ptr + group_index, mask=gmask, other=0.0).to(tl.float32)
            offset = tl.load(offsets_ptr + group_index, mask=gmask, other=0.0)
            w = (codes.to(tl.float32) * scale - offset).to(a.dtype)
        elif MXFP4:
            ks = k0 + kk
            wmask = kmask[:, None] & cmask[None, :]
            packed = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] // 2, mask=wmask,
                             other=0)
            codes = (packed >> ((ks[:, None] % 2) * 4)) & 0xF
            exponent = tl.load(scales_ptr + expert * stride_se + cols[None, :] * (k // 32) + ks[:, None] // 32,
                               mask=wmask, other=127)
            w = (_e2m1_value(codes) * tl.exp2(exponent.to(tl.float32) - 127.0)).to(a.dtype)
        elif EVEN_K:
            w = tl.load(w_cols + k0, mask=cmask[None, :], other=0.0)
        else:
            w = tl.load(w_cols + k0, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + slots, mask=smask, other=0.0)[:, None]
    tl.store(c_ptr + slots[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=smask[:, None] & cmask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor | Int4Experts | Mxfp4Experts | Q6KExperts | Q8Experts,
                  c: torch.Tensor,
                  sorted_slots: torch.Tensor, block_expert: torch.Tensor, topk_weights: torch.Tensor | None,
                  bias: torch.Tensor | None, a_row_div: int, config: MoEConfig) -> None:
    """``c[slot] = a[slot // a_row_div] @ w[expert(slot)].T`` plus the expert's ``bias [E, N]`` when given,
    times the slot's weight when given (GGUF experts on their own kernels, ``kernels/cuda/gguf_linear.py``)."""
    if isinstance(w, (Q6KExperts, Q8Experts)):
        return gguf_grouped_gemm(a, w, c, sorted_slots, block_expert, topk_weights, bias, a_row_div, config.block_m,
                                 config.num_warps)
    num_experts, n, k = w.shape
    int4, mxfp4 = isinstance(w, Int4Experts), isinstance(w, Mxfp4Experts)
    block_n = min(config.block_n, _INT4_MAX_BLOCK_N if int4 or mxfp4 else config.block_n,
                  max(16, triton.next_power_of_2(n)))
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    if int4 and w.g_idx is None and w.group_size < block_k:  # tiles of one group (GGUF Q4_K's 32): per-weight
        block_k = w.group_size  # scales and offsets in shared memory took up to 327,680 B
    num_mblocks = block_expert.shape[0]
    grid = (num_mblocks * triton.cdiv(n, block_n),)
    weight = w.qweight if int4 else w.blocks if mxfp4 else w
    scales, offsets, g_idx = (w.scales, w.offsets, w.g_idx) if int4 else (w.scales, None, None) if mxfp4 else (
        None, None, None)
    _grouped_gemm_kernel[grid](a, weight, c, sorted_slots, block_expert, topk_weights, bias, scales, offsets, g_idx,
                               c.shape[0], num_mblocks, n, k, num_experts, a_row_div, w.group_size if int4 else 0,
                               a.stride(0), weight.stride(0), weight.stride(1), c.stride(0),
                               0 if bias is None else bias.stride(0), 0 if scales is None else scales.stride(0),
                               MUL_WEIGHT=topk_weights is not None, HAS_BIAS=bias is not None, INT4=int4, MXFP4=mxfp4,
                               HAS_GIDX=g_idx is not None,
                               ONE_GROUP=int4 and g_idx is None and w.group_size % block_k == 0,
                               BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=config.group_m,
                               EVEN_K=k % block_k == 0,
                               PRECISION=dot_precision(a.dtype), num_warps=config.num_warps,
                               num_stages=config.num_stages)


def moe_config(num_slots: int, num_experts: int) -> MoEConfig:
    """The table's config for ``num_slots / num_experts`` routed slots per expert on average."""
    return next(config for limit, config in MOE_CONFIGS if num_slots / num_experts <= limit)


def fused_moe_with(hidden: torch.Tensor, gate_up: torch.Tensor | Int4Experts | Mxfp4Experts,
                   down: torch.Tensor | Int4Experts | Mxfp4Experts,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: MoEConfig,
                   gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                   activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """``fused_moe`` with explicit tiles (benchmarks and tests)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    sorted_slots, block_expert = align_by_expert(topk_ids, num_experts, config.block_m)
    # One buffer serves the gate_up output, then (after SiLU-and-mul read it) the down output.
    buf = torch.empty(num_slots * max(two_inter, hidden_size), dtype=hidden.dtype, device=hidden.device)
    gate_up_out = buf[:num_slots * two_inter].view(num_slots, two_inter)
    _grouped_gemm(hidden, gate_up, gate_up_out, sorted_slots, block_expert, None, gate_up_bias, top_k, config)
    act = silu_and_mul(gate_up_out) if activation is None else clamped_swiglu(gate_up_out, activation)
    down_out = buf[:num_slots * hidden_size].view(num_slots, hidden_size)
    _grouped_gemm(act, down, down_out, sorted_slots, block_expert, topk_weights.flatten().float(), down_bias, 1,
                  config)
    return down_out.view(num_tokens, top_k, hidden_size).sum(1)


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor | Int4Experts | Mxfp4Experts,
              down: torch.Tensor | Int4Experts | Mxfp4Experts,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """``sum_j w[t, j] * down[e] @ act(gate_up[e] @ hidden[t])`` with ``e = ids[t, j]``; ``[T, H]``.

    ``gate_up [E, 2I, H]`` holds gate rows then up rows, ``down [E, H, I]``; weights are row-major
    in their last dimension, or :class:`Int4Experts`, :class:`Mxfp4Experts` (GGUF blocks: ``Q6KExperts``,
    ``Q8Experts``) of those shapes. The optional biases ``[E, 2I]`` and ``[E, H]`` are added to each GEMM's output
    (before the routing weight); ``act`` is SiLU-and-mul, or ``activation`` when given.
    """
    config = moe_config(topk_ids.numel(), gate_up.shape[0])
    return fused_moe_with(hidden, gate_up, down, topk_weights, topk_ids, config, gate_up_bias, down_bias, activation)
