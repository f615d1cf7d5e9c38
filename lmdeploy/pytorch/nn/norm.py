"""RMSNorm and LayerNorm layers, and the q/k RMSNorms over all heads together that tensor parallelism splits."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.distributed.parallel_state import Shard, current_group, head_ranges
from lmdeploy.pytorch.kernels import rms_norm
from lmdeploy.pytorch.nn.linear import QKVLinear


class RMSNorm(nn.Module):
    """RMSNorm; given ``residual`` it adds it first and also returns the sum."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, summed = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, summed)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight ``w`` scales by ``1 + w`` (it starts at zeros)."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, summed = rms_norm(x, self.scale(x.dtype), self.eps, residual)
        return out if residual is None else (out, summed)

    def scale(self, dtype: torch.dtype) -> torch.Tensor:
        """``1 + weight`` in ``dtype``: the weight of a plain RMSNorm that gives the same result."""
        return (self.weight.float() + 1.0).to(dtype)


class LayerNorm(RMSNorm):
    """LayerNorm computed in fp32: ``(x - mean) / std * weight``, plus ``bias`` where it has one (StarCoder2's; not
    Cohere's); given ``residual`` it adds it first and also returns the sum."""

    def __init__(self, size: int, eps: float, bias: bool = False):
        super().__init__(size, eps)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        summed = x if residual is None else x + residual
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(summed.float(), self.weight.shape, self.weight.float(), bias, self.eps).to(x.dtype)
        return out if residual is None else (out, summed)


class HeadsRMSNorm(RMSNorm):
    """RMSNorm over the features of all of an attention's query (or key) heads together, ``total`` of them (OLMo 2's
    and MiniMax-M2's q/k norms). Under tensor parallelism this rank holds its heads' ``features`` of the weight and
    :func:`norm_across_heads` sums each row's squares over the ranks; ``counted``: whether this rank's squares count
    (not on the ranks after the first that hold a replicated KV head)."""

    def __init__(self, features: tuple[int, int], total: int, eps: float, counted: bool = True):
        super().__init__(features[1] - features[0], eps)
        self.features, self.total, self.counted = features, total, counted
        self.tp = current_group()

    def checkpoint_part(self, kind: str) -> tuple[torch.Tensor, Shard | None]:
        """The weight and this rank's share of the checkpoint's (None: all of it)."""
        return getattr(self, kind), None if self.tp.world_size == 1 else Shard(0, *self.features)

    def squares(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of squares of each row of ``x`` in fp32 ``[T]`` (zeros where this rank's do not count)."""
        squares = x.float().square().sum(-1)
        return squares if self.counted else torch.zeros_like(squares)

    def scale(self, x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """``x`` normed by its rows' sums of squares over all heads, then weighted (rounded as the kernel rounds)."""
        normed = (x.float() * torch.rsqrt(squares / self.total + self.eps)[:, None]).to(x.dtype)
        return (normed.float() * self.weight.float()).to(x.dtype)


def qk_norms_across_heads(qkv: QKVLinear, eps: float) -> tuple[HeadsRMSNorm, HeadsRMSNorm]:
    """The q and k :class:`HeadsRMSNorm` of the attention whose projection is ``qkv``: this rank's shares of them."""
    tp = current_group()
    num_kv_heads = qkv.out_sizes[1] // qkv.head_dim

    def kv_heads(rank: int) -> tuple[int, int]:
        return head_ranges(qkv.num_heads_total, num_kv_heads, rank, tp.world_size)[1]

    first_holder = all(kv_heads(rank) != kv_heads(tp.rank) for rank in range(tp.rank))
    return (HeadsRMSNorm(qkv.ranges[0], qkv.out_sizes[0], eps),
            HeadsRMSNorm(qkv.ranges[1], qkv.out_sizes[1], eps, counted=first_holder))


def norm_across_heads(q_norm: HeadsRMSNorm, k_norm: HeadsRMSNorm, q: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries ``q [T, H * D]`` and keys ``k [T, H_kv * D]`` (this rank's heads) normed over all heads; under
    tensor parallelism with one all-reduce of each row's two sums of squares ``[T, 2]``."""
    if q_norm.tp.world_size == 1:
        return q_norm(q), k_norm(k)
    squares = q_norm.tp.all_reduce(torch.stack((q_norm.squares(q), k_norm.squares(k)), dim=-1))
    return q_norm.scale(q, squares[:, 0]), k_norm.scale(k, squares[:, 1])
