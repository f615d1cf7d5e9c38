"""Mixture-of-experts routing and expert compute in torch: the CPU path and the reference."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU, clamped_swiglu, silu_and_mul


def moe_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: ``(topk_weights [T, k] fp32, topk_ids [T, k])``."""
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(act(gate_up_e(x)))`` with ``e = topk_ids[t, k]``.

    ``gate_up [E, 2I, H]`` holds each expert's gate rows then up rows, ``down [E, H, I]``; the optional
    biases ``gate_up_bias [E, 2I]`` and ``down_bias [E, H]`` are added before the activation and before
    the routing weight. ``act`` is SiLU-and-mul, or ``activation`` when given. Only experts that
    received tokens run (see :func:`run_experts`).
    """

    def mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        x = F.linear(x, gate_up[expert], None if gate_up_bias is None else gate_up_bias[expert])
        x = silu_and_mul(x) if activation is None else clamped_swiglu(x, activation)
        return F.linear(x, down[expert], None if down_bias is None else down_bias[expert])

    return run_experts(hidden, topk_weights, topk_ids, gate_up.shape[0], mlp)


def run_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``sum_k w[t, k] * mlp(e, x[t])`` with ``e = topk_ids[t, k]``: each expert that received tokens runs
    ``mlp`` once on all of its rows; results are combined in expert order with ``index_add_``."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens = order // top_k
    weights = topk_weights.flatten()[order].to(hidden.dtype)
    out = torch.zeros_like(hidden)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        out.index_add_(0, rows, mlp(expert, hidden[rows]) * weights[start:start + count, None])
        start += count
    return out


def grouped_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, num_groups: int,
                 topk_groups: int, renormalize: bool, scaling: float, renormalize_eps: float = 1e-20,
                 softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (``noaux_tc``): ``(topk_weights [T, k] fp32, topk_ids [T, k])``.

    Experts score ``sigmoid(logits)`` (``softmax``: Mistral 4's softmax over the experts); they are chosen by score
    plus ``correction_bias`` (None: none), among the ``topk_groups`` of ``num_groups`` equal groups whose two best
    biased scores sum highest. The weights are the chosen experts' unbiased scores, renormalized to sum to one when
    asked (divided by their sum plus ``renormalize_eps``: LFM2-MoE's 1e-6), times ``scaling``.
    """
    if softmax:
        scores = router_logits.float().softmax(-1)
    else:
        # torch's sigmoid takes a vectorized exp but for a tensor's last few elements, a scalar one: in fp32 they
        # differ in the last bit, so a row's scores changed with its place in the batch; in fp64, far below fp32's
        # rounding
        scores = router_logits.double().sigmoid().float()
    biased = scores if correction_bias is None else scores + correction_bias.float()
    grouped = biased.view(scores.shape[0], num_groups, -1)
    best_groups = grouped.topk(2, dim=-1)[0].sum(-1).topk(topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
    biased = biased.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float('-inf'))
    ids = biased.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + renormalize_eps)
    return weights * scaling, ids


def group_limited_topk(router_logits: torch.Tensor, top_k: int, num_groups: int,
                       topk_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's ``group_limited_greedy`` routing: ``(topk_weights [T, k] fp32, topk_ids [T, k])``, the
    top-k softmax scores among the experts of the ``topk_groups`` of ``num_groups`` groups whose best score is
    highest; not renormalized."""
    scores = router_logits.float().softmax(-1)
    grouped = scores.view(scores.shape[0], num_groups, -1)
    best_groups = grouped.max(-1).values.topk(topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
    scores = scores.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
    return torch.topk(scores, top_k, dim=-1, sorted=False)


def biased_softmax_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                        norm_min: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ERNIE 4.5's routing: ``(topk_weights [T, k] fp32, topk_ids [T, k])``, the experts chosen by softmax score
    plus ``correction_bias``, weighted by their unbiased scores divided by their sum (at least ``norm_min``); with
    ``norm_min`` None (LongCat-Flash) the unbiased scores as they are."""
    scores = router_logits.float().softmax(-1)
    ids = (scores + correction_bias.float().reshape(-1)).topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if norm_min is None:
        return weights, ids
    return weights / weights.sum(-1, keepdim=True).clamp(min=norm_min), ids
