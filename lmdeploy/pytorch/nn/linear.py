"""Linear layers; a merged one stacks several projections so they run as one matmul.

A layer holds its weight in the format of the model's checkpoint (:mod:`lmdeploy.pytorch.nn.quant`:
the parameters the checkpoint fills) and multiplies by it with that format's kernel, chosen again once
the weights are loaded (:meth:`Linear.finalize`: on the CPU, bf16 weights packed for their GEMM, and a
4-bit copy for small steps). The gate and up projections of a gated MLP (``GateUpLinear``) apply
SiLU-and-mul in the native GEMM's epilogue.

Under tensor parallelism (the :class:`TPGroup` current at construction) merged layers and
:class:`ColumnLinear` are column-parallel: each rank holds its share of every projection's output rows (:class:`QKVLinear` its
attention heads); :class:`RowLinear` holds a share of the input columns and sums the ranks' partial
products. ``checkpoint_part`` says which part of a checkpoint tensor a rank's parameter holds; each
parameter's :class:`Layout` says along which dimensions that part runs.
"""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.distributed.parallel_state import (Shard, current_group, head_ranges, split_blocks,
                                                         split_range)
from lmdeploy.pytorch.kernels import silu_and_mul
from lmdeploy.pytorch.kernels.activation import gelu_tanh_and_mul
from lmdeploy.pytorch.nn.quant import (Layout, LinearKernel, LinearOptions, WeightFormat, current_weight_format,
                                       layout_of, new_parameter, weights_device)


class Linear(nn.Module):
    """``y = x @ W.T + b``, ``W`` in the weight format current at construction."""

    gate_up_panels = False  # whether a native packing alternates gate and up panels (GateUpLinear)

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = new_parameter((out_features,), Layout(0, None)) if bias else None
        self.set_weight_format(current_weight_format())

    def set_weight_format(self, weight_format: WeightFormat) -> None:
        """(Re)creates the weight's parameters in ``weight_format``, uninitialized (on the meta device while a
        model is built, see :func:`~lmdeploy.pytorch.nn.quant.defer_weights`): once the model is built each
        layer takes the format its name picks (a checkpoint whose layers differ in format); before loading."""
        for name in [name for name in self._parameters if name != 'bias']:
            delattr(self, name)
        self.weight_format = weight_format
        with weights_device():
            weight_format.create_weights(self)
        self.kernel: LinearKernel = weight_format.make_kernel(self, LinearOptions())

    def finalize(self, options: LinearOptions) -> None:
        """Lays the loaded weight out for its kernel (see :class:`LinearOptions`); once."""
        self.kernel = self.weight_format.make_kernel(self, options)

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        """The parameter ``kind`` (``weight``, ``bias``, a format's scales...), or its share of projection
        ``part`` in a merged layer, and the part of the checkpoint tensor that fills it (None: all of it)."""
        return getattr(self, kind), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.bias)


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

    @classmethod
    def after(cls, gate_up: GateUpLinear | ColumnLinear, out_features: int, bias: bool = False) -> RowLinear:
        """The down projection of the MLP whose gate and up ``gate_up`` (or whose ungated up projection) computes:
        each rank holds the input features of its own share of the intermediate ones."""
        if isinstance(gate_up, ColumnLinear):
            return cls(gate_up.out_total, out_features, bias, gate_up.out_range)
        return cls(gate_up.out_sizes[0], out_features, bias, gate_up.ranges[0])

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        param = getattr(self, kind)
        layout = layout_of(param)
        if layout.input_dim is None or self.tp.world_size == 1:
            return param, None
        start, stop = (bound // layout.inputs_per_index for bound in self.in_range)
        return param, Shard(layout.input_dim, start, stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.kernel(x, self.bias)
        out = self.tp.all_reduce(self.kernel(x, None))
        return out if self.bias is None else out + self.bias


class ColumnLinear(Linear):
    """Column-parallel: each rank holds the output rows ``out_range`` (an even share, in whole blocks of the format
    where it can: the input features of the :class:`RowLinear` after it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = current_group()
        self.out_total = out_features
        self.out_range = split_blocks(out_features, current_weight_format().split_granule, self.tp.rank,
                                      self.tp.world_size)
        super().__init__(in_features, self.out_range[1] - self.out_range[0], bias)

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        param = getattr(self, kind)
        layout = layout_of(param)
        if layout.output_dim is None or self.tp.world_size == 1:
            return param, None
        return param, Shard(layout.output_dim, *(bound // layout.outputs_per_index for bound in self.out_range))


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension; column-parallel: each
    rank holds the rows ``ranges[i]`` of projection ``i`` (of ``out_sizes[i]`` rows in all)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 ranges: list[tuple[int, int]] | None = None):
        tp = current_group()
        self.out_sizes = list(out_sizes)
        self.ranges = ranges or [split_range(size, tp.rank, tp.world_size) for size in out_sizes]
        local_sizes = [stop - start for start, stop in self.ranges]
        super().__init__(in_features, sum(local_sizes), bias)
        self.offsets = [sum(local_sizes[:i]) for i in range(len(local_sizes) + 1)]
        self.sharded = local_sizes != list(out_sizes)

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        param = getattr(self, kind)
        layout = layout_of(param)
        if layout.output_dim is None:
            return param, None
        per = layout.outputs_per_index
        start, stop = self.offsets[part] // per, self.offsets[part + 1] // per
        rows = param.narrow(layout.output_dim, start, stop - start)
        shard = Shard(layout.output_dim, *(bound // per for bound in self.ranges[part])) if self.sharded else None
        return rows, shard


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
    """The gate and up projections of a gated MLP, stacked; ``forward`` returns ``silu(gate) * up``, or
    with ``activation='gelu_tanh'`` (Gemma) ``gelu_tanh(gate) * up``.

    With the native GEMM SiLU runs on the GEMM's registers (gate and up panels alternate in the packed
    weight), so the ``[T, 2 * I]`` product is never written out nor read back.
    """

    def __init__(self, in_features: int, intermediate_size: int, bias: bool = False, activation: str = 'silu'):
        if activation not in ('silu', 'gelu_tanh'):
            raise ValueError(f'activation {activation!r} is not supported')
        self.gate_up_panels = activation == 'silu'
        # a rank's share of the intermediate features in whole blocks of the format (its down projection's inputs)
        tp = current_group()
        share = split_blocks(intermediate_size, current_weight_format().split_granule, tp.rank, tp.world_size)
        super().__init__(in_features, [intermediate_size] * 2, bias, [share, share])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gate_up_panels:
            return gelu_tanh_and_mul(self.kernel(x, self.bias))
        fused = self.kernel.gate_up_silu(x, self.bias)
        return fused if fused is not None else silu_and_mul(self.kernel(x, self.bias))
