"""Experts of a mixture-of-experts layer: each projection's parameters stacked over the experts, in the weight
format of the checkpoint, and run by that format's expert kernel (the fused-MoE kernel for dense weights).

Under tensor parallelism each rank holds every expert's share of the intermediate features (gate and
up rows, down columns) and the ranks' partial outputs are summed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.distributed.parallel_state import Shard, TPGroup, current_group, split_blocks
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.nn.quant import (Layout, LinearOptions, WeightFormat, current_weight_format, layout_of,
                                       new_parameter, weights_device)
from lmdeploy.pytorch.nn.quant.cpu_fp32 import NativeFp32Kernel, native_fp32_kernel


class Fp32Router(nn.Module):
    """A router kept in fp32 as the checkpoint holds it, whatever the model's dtype (DeepSeek-V3's, GLM-4.5's,
    ERNIE 4.5's): ``weight [E, hidden]``; its logits ``x @ weight.T`` in fp32. On the CPU (AVX-512, or AVX2 with
    FMA) they run the fixed-order fp32 GEMM on the packed copy that :meth:`finalize` makes in the weight's place, so
    that a token's routing does not depend on its batch (torch's fp32 GEMM picks its order of summation by the
    number of rows)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = new_parameter((num_experts, hidden_size), Layout(None, None), torch.float32)
        self.kernel: NativeFp32Kernel | None = None

    def finalize(self) -> None:
        """Packs the loaded weight for the native fp32 GEMM where it runs, and releases it then: the packed copy is
        the router's only one (the native decoder stack's too, see :meth:`native_projection`)."""
        self.kernel = native_fp32_kernel(self.weight)
        if self.kernel is not None:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 logits ``[T, E]`` of ``x [T, hidden]`` (any float dtype)."""
        x = x.float()
        return F.linear(x, self.weight) if self.kernel is None else self.kernel(x, None)

    def native_projection(self) -> object | None:
        """This router as the native decoder stack's ``fp32`` projection on the packed copy (the same GEMM and
        tiles); None where the packed GEMM does not run it."""
        if self.kernel is None:
            return None
        return cpu.native().Projection(kind='fp32', weight=self.kernel.packed, outputs=self.kernel.out_features,
                                       isa=self.kernel.isa)


class ExpertProjection(nn.Module):
    """One projection of one expert, ``in_features`` to ``out_features``, as a weight format's
    ``create_weights`` and ``unpack`` take a linear layer: the template of the stacked parameters, or one
    expert's slices of them (:meth:`FusedExperts.projection`)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup | None = None):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp


class FusedExperts(nn.Module):
    """Every expert's MLP: the gate-and-up projection ``[2I, H]`` (gate rows, then up rows) and the down
    projection ``[H, I]``, with ``I`` this rank's share of the intermediate size, each in the weight format
    current at construction. A format parameter ``kind`` of a projection is stacked over the experts as
    ``{projection}`` for ``weight`` (dense: ``gate_up [E, 2I, H]``, ``down [E, H, I]``) and
    ``{projection}_{kind}`` for the others (AWQ: ``gate_up_qweight [E, H, 2I / 8]``...); its layout is one
    expert's.

    With ``bias`` (gpt-oss) the experts also hold ``gate_up_bias [E, 2I]`` and ``down_bias [E, H]``; the
    down bias is added on the first rank only, before the ranks' outputs are summed. The activation is
    SiLU-and-mul, or ``activation`` when given.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, bias: bool = False,
                 activation: ClampedSwiGLU | None = None):
        super().__init__()
        self.tp = current_group()
        self.full_intermediate_size = intermediate_size
        self.hidden_size, self.num_experts, self.activation, self.has_bias = hidden_size, num_experts, activation, bias
        self.kinds: dict[str, tuple[str, ...]] = {}
        self.set_weight_format(current_weight_format())

    def set_weight_format(self, weight_format: WeightFormat) -> None:
        """(Re)creates the stacked parameters in ``weight_format`` (each projection in its
        ``expert_format``), uninitialized (on the meta device while a model is built, see
        :func:`~lmdeploy.pytorch.nn.quant.defer_weights`): once the model is built each MoE layer takes the format
        its name picks (a GGUF file of mixed types); before loading."""
        for proj, kinds in self.kinds.items():
            for kind in kinds:
                delattr(self, self.param_name(proj, kind))
        self.weight_format = weight_format
        self.range = self.share(weight_format.expert_format('down').split_granule)
        self.intermediate_size = size = self.range[1] - self.range[0]
        hidden_size = self.hidden_size
        with torch.device('meta'):  # one expert's parameters: only their shapes, dtypes and layouts are read
            templates = {'gate_up': ExpertProjection(hidden_size, 2 * size),
                         'down': ExpertProjection(size, hidden_size, self.tp)}
            for proj, template in templates.items():
                weight_format.expert_format(proj).create_weights(template)
                if self.has_bias:
                    template.bias = new_parameter((template.out_features,), Layout(0, None))
        with weights_device():
            for proj, template in templates.items():
                self.kinds[proj] = tuple(kind for kind, _ in template.named_parameters())
                for kind, param in template.named_parameters():
                    stacked = new_parameter((self.num_experts, *param.shape), layout_of(param),
                                            param.dtype if param.keep_dtype else None)
                    setattr(self, self.param_name(proj, kind), stacked)
        self.gate_up_bias = getattr(self, 'gate_up_bias', None)
        self.down_bias = getattr(self, 'down_bias', None)
        self.kernel = weight_format.make_expert_kernel(self, LinearOptions())

    def share(self, granule: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of the intermediate features, in whole blocks of ``granule`` (of the down
        projection's format) where the size allows (gpt-oss-120b's 2,880 MXFP4 features over 4 ranks: 23, 23, 22
        and 22 blocks of 32; see :func:`split_blocks`)."""
        return split_blocks(self.full_intermediate_size, granule, self.tp.rank, self.tp.world_size)

    @staticmethod
    def param_name(proj: str, kind: str) -> str:
        return proj if kind == 'weight' else f'{proj}_{kind}'

    def finalize(self, options: LinearOptions) -> None:
        """Lays the loaded weights out for their kernel (see :class:`LinearOptions`); once."""
        self.kernel = self.weight_format.make_expert_kernel(self, options)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        down_bias = self.down_bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(self.kernel(x, topk_weights, topk_ids, self.gate_up_bias, down_bias,
                                              self.activation))

    def native_experts(self, small_step: bool = False) -> dict[str, object] | None:
        """The experts as a ``MoEBlock`` of the native decoder stack takes them, by name: their kernel's native
        weights with the biases (``small_step``: for the stack of small steps, see
        :meth:`~lmdeploy.pytorch.nn.quant.ExpertKernel.native_experts`), and the clamped SwiGLU (``activation``,
        ``swiglu_alpha``, ``swiglu_limit``) where they have it; None when no native kernel runs them."""
        native = self.kernel.native_experts(self.gate_up_bias, self.down_bias, small_step)
        if native is None or self.activation is None:
            return native
        return native | dict(activation='clamped_swiglu', swiglu_alpha=self.activation.alpha,
                             swiglu_limit=self.activation.limit)

    def projection(self, proj: str, expert: int) -> ExpertProjection:
        """Expert ``expert``'s ``gate_up`` or ``down`` projection: its slices of the stacked parameters (as
        they are now), as the weight format's ``unpack`` takes them."""
        size = self.intermediate_size
        layer = ExpertProjection(*((self.hidden_size, 2 * size) if proj == 'gate_up' else (size, self.hidden_size)))
        for kind in self.kinds[proj]:
            if kind != 'bias':
                setattr(layer, kind, getattr(self, self.param_name(proj, kind))[expert])
        return layer

    def release(self) -> None:
        """Drops the stacked parameters of the weight format (not the biases): for a kernel that holds its own
        copy of them."""
        for proj, kinds in self.kinds.items():
            for kind in kinds:
                if kind != 'bias':
                    setattr(self, self.param_name(proj, kind), None)

    def expert_weight(self, expert: int, part: str,
                      kind: str = 'weight') -> tuple[torch.Tensor, str, str, Shard | None] | None:
        """The slice that one expert's ``gate``, ``up`` or ``down`` tensor ``kind`` (``weight``, ``bias``, a
        format's ``qweight``...) fills, its parameter's name, the shard's label (see :meth:`weight_shards`)
        and the part of the checkpoint tensor that fills it; None for a tensor the format does not use."""
        proj = 'down' if part == 'down' else 'gate_up'
        if kind not in self.kinds[proj]:
            return None
        name = self.param_name(proj, kind)
        param = getattr(self, name)
        layout, label, sharded = layout_of(param), f'expert {expert} {part}', self.tp.world_size > 1
        if proj == 'down':
            if layout.input_dim is None or not sharded:
                return param[expert], name, label, None
            start, stop = (bound // layout.inputs_per_index for bound in self.range)
            return param[expert], name, label, Shard(layout.input_dim, start, stop)
        if layout.output_dim is None:  # gate and up share it (GPTQ's g_idx: the same inputs)
            return param[expert], name, label, None
        per = layout.outputs_per_index
        size = self.intermediate_size // per
        rows = param[expert].narrow(layout.output_dim, 0 if part == 'gate' else size, size)
        start, stop = (bound // per for bound in self.range)
        return rows, name, label, Shard(layout.output_dim, start, stop) if sharded else None

    def weight_shards(self) -> dict[str, list[str]]:
        """Each parameter's shards that the checkpoint must fill: every expert's gate, up and down."""
        experts = range(self.num_experts)
        parts = {'gate_up': ('gate', 'up'), 'down': ('down',)}
        return {self.param_name(proj, kind): [f'expert {e} {part}' for e in experts for part in parts[proj]]
                for proj, kinds in self.kinds.items() for kind in kinds}
