"""Fused MoE in Triton: softmax top-k routing, tokens sorted by expert, grouped GEMMs, weighted combine.

Routed slots ``(token, j)`` are flattened to ``token * top_k + j``, sorted by expert and padded so
that every ``BLOCK_M`` rows belong to one expert; padding rows hold the sentinel ``T * top_k``.
Nothing here synchronizes with the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.cuda.elementwise import silu_and_mul
from lmdeploy.pytorch.kernels.cuda.utils import dot_precision


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


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_slots [P], block_expert [P // block_m])``: slots grouped by expert, each group padded
    to ``block_m``; ``P`` is the worst case, unused blocks get expert ``num_experts``."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(num_slots, device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
    capacity = triton.cdiv(num_slots + num_experts * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_slots[(padded_end - padded)[flat[order]] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_slots, block_expert


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, slots_ptr, block_expert_ptr, topk_w_ptr, num_slots, n, k,
                         num_experts, a_row_div, stride_am, stride_we, stride_wn, stride_cm,
                         MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    mblock = tl.program_id(0)
    expert = tl.load(block_expert_ptr + mblock).to(tl.int64)
    if expert >= num_experts:
        return
    slots = tl.load(slots_ptr + mblock * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    smask = slots < num_slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (slots // a_row_div)[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kmask = (k0 + kk) < k
        a = tl.load(a_rows + (k0 + kk)[None, :], mask=smask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + kk)[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + slots, mask=smask, other=0.0)[:, None]
    tl.store(c_ptr + slots[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=smask[:, None] & cmask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, sorted_slots: torch.Tensor,
                  block_expert: torch.Tensor, topk_weights: torch.Tensor | None, a_row_div: int,
                  block_m: int) -> None:
    """``c[slot] = a[slot // a_row_div] @ w[expert(slot)].T``, times the slot's weight when given."""
    num_experts, n, k = w.shape
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, w, c, sorted_slots, block_expert, topk_weights, c.shape[0], n, k, num_experts,
                               a_row_div, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                               MUL_WEIGHT=topk_weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               PRECISION=dot_precision(a.dtype))


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_j w[t, j] * down[e] @ silu_and_mul(gate_up[e] @ hidden[t])`` with ``e = ids[t, j]``; ``[T, H]``.

    ``gate_up [E, 2I, H]`` holds gate rows then up rows, ``down [E, H, I]``; weights are row-major
    in their last dimension.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    block_m = 16 if num_slots <= 4 * num_experts * 16 else 64
    sorted_slots, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    # One buffer serves the gate_up output, then (after SiLU-and-mul read it) the down output.
    buf = torch.empty(num_slots * max(two_inter, hidden_size), dtype=hidden.dtype, device=hidden.device)
    gate_up_out = buf[:num_slots * two_inter].view(num_slots, two_inter)
    _grouped_gemm(hidden, gate_up, gate_up_out, sorted_slots, block_expert, None, top_k, block_m)
    act = silu_and_mul(gate_up_out)
    down_out = buf[:num_slots * hidden_size].view(num_slots, hidden_size)
    _grouped_gemm(act, down, down_out, sorted_slots, block_expert, topk_weights.flatten().float(), 1, block_m)
    return down_out.view(num_tokens, top_k, hidden_size).sum(1)
