"""Linear layers; a merged one stacks several projections so they run as one matmul.

On the CPU a bf16 layer keeps its weight packed for its GEMM (``pack_for_cpu``): the native
AVX512-BF16 kernel's panels where that beats oneDNN (no AMX), else oneDNN's blocked layout, which
saves oneDNN's per-call reorder (15-45% faster for decode-sized batches). A layer may also hold its
weight as 4-bit groups for small steps (``enable_int4``): torch's int4 kernel reads a quarter of the
bytes, which is what a batch-1 decode step is bound by. The gate and up projections of a gated MLP
(``GateUpLinear``) apply SiLU-and-mul in the native GEMM's epilogue.

Under tensor parallelism (the :class:`TPGroup` current at construction) merged layers are
column-parallel: each rank holds its share of every projection's output rows (:class:`QKVLinear` its
attention heads); :class:`RowLinear` holds a share of the input columns and sums the ranks' partial
products. ``checkpoint_part`` says which part of a checkpoint tensor a rank's parameter holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.distributed.parallel_state import Shard, current_group, head_ranges, split_range
from lmdeploy.pytorch.kernels import cpu, silu_and_mul


INT4_GROUP = 32
# Steps of more tokens run faster on bf16 weights: with the native GEMM, or with oneDNN's.
INT4_MAX_TOKENS_NATIVE_GEMM = 2
INT4_MAX_TOKENS_ONEDNN = 8


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as 4-bit codes on each group of 32 inputs' min/max grid (``(q - 8) * scale + zero``):
    the packed codes and ``scales_and_zeros [K / 32, N, 2]`` (bf16) of torch's int4 CPU kernel.

    A GGUF Q4_1 block spans exactly its min and max in 16 steps, so its grid comes back exactly.
    """
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(out_features, in_features), 2)
    scales_and_zeros = torch.stack((scale.T, (low + 8 * scale).T), dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


@dataclass
class PackedWeight:
    """A bf16 CPU weight laid out for the GEMM that runs it: the native AVX512-BF16 kernel's panels
    (``native``) or oneDNN's blocked layout (CPUs with AMX, or no native kernels)."""

    data: torch.Tensor
    native: bool
    gate_up: bool = False  # native panels alternating gate and up, for ``bf16_gate_up_silu``


def pack_for_cpu(weight: torch.Tensor, gate_up: bool = False) -> PackedWeight | None:
    """``weight [N, K]`` packed for :func:`packed_linear`; None unless it is a bf16 CPU weight. With
    ``gate_up`` (gate then up rows) the native GEMM's panels alternate gate and up instead."""
    if weight.dtype != torch.bfloat16 or weight.device.type != 'cpu':
        return None
    gemm = cpu.bf16_gemm()
    if gemm is not None and weight.shape[0] % (32 if gate_up else 16) == 0 and weight.shape[1] % 2 == 0:
        pack = gemm.pack_bf16_gate_up if gate_up else gemm.pack_bf16_weight
        return PackedWeight(pack(weight), native=True, gate_up=gate_up)
    if not torch.backends.mkldnn.is_available():
        return None
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight), native=False)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on a weight from :func:`pack_for_cpu` (the same results up to summation order)."""
    if packed.native:
        return cpu.native().bf16_linear(x, packed.data, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, 'none', [], '')


class Linear(nn.Module):
    """``y = x @ W.T + b`` with weights in the model dtype."""

    gate_up_panels = False  # whether a native packing alternates gate and up panels (GateUpLinear)

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.int4: tuple[torch.Tensor, torch.Tensor] | None = None
        self.int4_max_tokens = 0
        self.packed: PackedWeight | None = None

    def enable_int4(self) -> bool:
        """Keeps a 4-bit copy of a bf16 CPU weight for steps too small to keep the bf16 GEMM busy;
        False when the layer cannot use it."""
        weight = self.weight
        if weight.dtype != torch.bfloat16 or weight.device.type != 'cpu' or weight.shape[1] % INT4_GROUP:
            return False
        self.int4 = int4_groups(weight)
        self.int4_max_tokens = INT4_MAX_TOKENS_NATIVE_GEMM if cpu.bf16_gemm() else INT4_MAX_TOKENS_ONEDNN
        return True

    def pack_for_cpu(self) -> bool:
        """Packs a bf16 CPU weight for its GEMM (``weight`` becomes None); False when it cannot."""
        self.packed = pack_for_cpu(self.weight, gate_up=self.gate_up_panels)
        if self.packed is None:
            return False
        self.weight = None
        return True

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        """The parameter ``kind`` (``weight``, ``bias``), or its rows of projection ``part`` in a merged
        layer, and the part of the checkpoint tensor that fills it (None: all of it)."""
        return getattr(self, kind), None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= self.int4_max_tokens:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4[0], INT4_GROUP, self.int4[1])
            return out if bias is None else out + bias
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowLinear(Linear):
    """Row-parallel: each rank holds a share of the input features (``in_range``, default an even share)
    and multiplies the matching share of ``x``; the partial products are summed over the ranks, then the
    bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 in_range: tuple[int, int] | None = None):
        self.tp = current_group()
        self.in_range = in_range or split_range(in_features, self.tp.rank, self.tp.world_size)
        super().__init__(self.in_range[1] - self.in_range[0], out_features, bias)

    @classmethod
    def over_heads(cls, qkv: QKVLinear, out_features: int, bias: bool = False) -> RowLinear:
        """The output projection of attention whose heads ``qkv`` computes: each rank holds the input
        features of its own heads."""
        return cls(qkv.num_heads_total * qkv.head_dim, out_features, bias, qkv.ranges[0])

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        if kind == 'bias' or self.tp.world_size == 1:
            return getattr(self, kind), None
        return self.weight, Shard(1, *self.in_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.matmul(x, self.bias)
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension; column-parallel: each
    rank holds the rows ``ranges[i]`` of projection ``i``."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 ranges: list[tuple[int, int]] | None = None):
        tp = current_group()
        self.ranges = ranges or [split_range(size, tp.rank, tp.world_size) for size in out_sizes]
        local_sizes = [stop - start for start, stop in self.ranges]
        super().__init__(in_features, sum(local_sizes), bias)
        self.offsets = [sum(local_sizes[:i]) for i in range(len(local_sizes) + 1)]
        self.sharded = local_sizes != list(out_sizes)

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        rows = getattr(self, kind)[self.offsets[part]:self.offsets[part + 1]]
        return rows, Shard(0, *self.ranges[part]) if self.sharded else None


class QKVLinear(MergedLinear):
    """The q, k and v projections of attention, stacked; each rank holds its share of the query heads
    and the KV heads they read (one replicated KV head when there are fewer KV heads than ranks).
    ``num_heads`` and ``num_kv_heads`` are this rank's."""

    def __init__(self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False):
        tp = current_group()
        (q_start, q_stop), (kv_start, kv_stop) = head_ranges(num_heads, num_kv_heads, tp.rank, tp.world_size)
        self.num_heads, self.num_kv_heads = q_stop - q_start, kv_stop - kv_start
        self.num_heads_total, self.head_dim = num_heads, head_dim
        kv = (kv_start * head_dim, kv_stop * head_dim)
        super().__init__(in_features, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, ranges=[(q_start * head_dim, q_stop * head_dim), kv, kv])


class GateUpLinear(MergedLinear):
    """The gate and up projections of a gated MLP, stacked; ``forward`` returns ``silu(gate) * up``.

    With the native GEMM the activation runs on the GEMM's registers (gate and up panels alternate in
    the packed weight), so the ``[T, 2 * I]`` product is never written out nor read back.
    """

    gate_up_panels = True

    def __init__(self, in_features: int, intermediate_size: int, bias: bool = False):
        super().__init__(in_features, [intermediate_size] * 2, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and self.packed.gate_up and x.shape[0] > self.int4_max_tokens:
            return cpu.native().bf16_gate_up_silu(x, self.packed.data, self.bias)
        return silu_and_mul(super().forward(x))
