"""4-bit weights in groups of inputs with a scale and an offset each: AWQ and GPTQ checkpoints store
``W[n, k] = (q[n, k] - zero[g(k), n]) * scale[g(k), n]`` (the offset is ``zero * scale``) with
``g(k) = k // G``, or ``g_idx[k]`` for GPTQ's act-order checkpoints; GGUF's Q4_K ``q * d * sc - dmin * m``.
Each checkpoint format packs the codes its own way (:meth:`Int4GroupFormat.unpack`); the kernels here
read the unpacked grid, served as it is:

- CPU, bf16 models: the native int4 GEMV (``kernels/cpu/linear_int4.cpp``) on the same grid, torch's int4 CPU
  kernel (``_weight_int4pack_mm_for_cpu``) where it is not built;
- CUDA: the Triton W4A16 GEMM (``kernels/cuda/w4a16.py``) on the codes repacked along the inputs;
- otherwise (fp32 models, the reference): unpack and ``F.linear`` on every call.

The experts of a mixture-of-experts layer stay in 4 bits the same way: on the CPU each routed expert's
projections run on the native int4 GEMV (``kernels/cpu/linear_int4.cpp``; torch's int4 kernel where it is not
built), on CUDA the Triton fused MoE dequantizes its weight tiles in registers, and the reference unpacks each
routed expert on every call.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import silu_and_mul
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU, clamped_swiglu
from lmdeploy.pytorch.kernels.moe import run_experts
from lmdeploy.pytorch.nn.quant.base import ExpertKernel, LinearKernel, LinearOptions, WeightFormat
from lmdeploy.pytorch.nn.quant.int4_cpu import TORCH_INT4_GROUP_SIZES, NativeInt4Kernel, TorchInt4Kernel

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.linear import Linear
    from lmdeploy.pytorch.nn.moe import FusedExperts

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The eight 4-bit fields of each int32 of ``packed``, lowest first, laid out along ``dim`` (which
    grows eightfold)."""
    shifts = SHIFTS.to(packed.device).view([-1] + [1] * (packed.dim() - dim - 1))
    fields = (packed.unsqueeze(dim + 1) >> shifts) & 15
    shape = list(packed.shape)
    shape[dim] *= 8
    return fields.reshape(shape)


@dataclass
class Int4Grid:
    """A linear weight's 4-bit grid, ``W = codes * scale - offset``: ``codes [N, K]`` (integers in 0-15),
    ``scales [K / G, N]`` (the checkpoint's dtype), ``offsets [K / G, N]`` (fp32; exact for an integer zero
    point times an fp16 or bf16 scale), and ``g_idx [K]`` (the group of each input; None: ``k // G``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    g_idx: torch.Tensor | None = None

    @classmethod
    def of_zeros(cls, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 g_idx: torch.Tensor | None = None) -> Int4Grid:
        """The grid of ``(codes - zeros) * scales`` (integer zero points)."""
        return cls(codes, scales, zeros * scales.float(), group_size, g_idx)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``W [N, K]`` in ``dtype`` (computed in fp32)."""
        if self.g_idx is None:  # groups of G consecutive inputs: broadcast each group's scale and offset
            n = self.codes.shape[0]
            codes = self.codes.view(n, -1, self.group_size)
            weight = codes * self.scales.T.float()[..., None] - self.offsets.T[..., None]
            return weight.view(n, -1).to(dtype)
        groups = self.g_idx.long()
        scales, offsets = self.scales.T.float()[:, groups], self.offsets.T[:, groups]
        return (self.codes * scales - offsets).to(dtype)

    def in_group_order(self) -> tuple[Int4Grid, torch.Tensor | None]:
        """This grid with its inputs sorted by group, so that each group is ``G`` consecutive inputs,
        and the input order that gives (None: already so); raises if the groups are not all of size ``G``."""
        if self.g_idx is None:
            return self, None
        groups = self.g_idx.long()
        if torch.equal(groups, torch.arange(groups.numel(), device=groups.device) // self.group_size):
            return Int4Grid(self.codes, self.scales, self.offsets, self.group_size), None
        if not torch.all(torch.bincount(groups, minlength=self.scales.shape[0]) == self.group_size):
            raise ValueError(f'g_idx groups are not all of {self.group_size} inputs')
        order = torch.argsort(groups, stable=True)
        return Int4Grid(self.codes[:, order], self.scales, self.offsets, self.group_size), order


class ReferenceKernel(LinearKernel):
    """Dequantizes the layer's parameters as they are at each call and runs ``F.linear``."""

    def __init__(self, weight_format: Int4GroupFormat, layer: Linear):
        self.weight_format, self.layer = weight_format, layer

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight_format.dequantize(self.layer).to(x.dtype), bias)


class PerExpertKernel(ExpertKernel):
    """Each routed expert's projections on linear kernels: ``kernel(projection, expert)`` for ``gate_up`` and
    ``down``."""

    def __init__(self, num_experts: int, kernel: Callable[[str, int], LinearKernel]):
        self.num_experts, self.kernel = num_experts, kernel
        self.small_step_rows = max(kernel(proj, 0).small_step_rows for proj in ('gate_up', 'down'))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                 activation: ClampedSwiGLU | None) -> torch.Tensor:

        def mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = self.kernel('gate_up', expert)
            bias = None if gate_up_bias is None else gate_up_bias[expert]
            if activation is not None:
                hidden = clamped_swiglu(gate_up(rows, bias), activation)
            else:
                hidden = gate_up.gate_up_silu(rows, bias)
                hidden = silu_and_mul(gate_up(rows, bias)) if hidden is None else hidden
            return self.kernel('down', expert)(hidden, None if down_bias is None else down_bias[expert])

        return run_experts(x, topk_weights, topk_ids, self.num_experts, mlp)

    def native_experts(self, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                       small_step: bool = False) -> dict[str, object] | None:
        biases = {'gate_up': gate_up_bias, 'down': down_bias}
        experts = {f'expert_{proj}': [self.kernel(proj, e).expert_projection(None if bias is None else bias[e],
                                                                             small_step)
                                      for e in range(self.num_experts)] for proj, bias in biases.items()}
        return None if any(p is None for projections in experts.values() for p in projections) else experts


class Int4GroupFormat(WeightFormat):
    """A checkpoint format of 4-bit grouped weights: subclasses register its parameters and unpack them."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    @abstractmethod
    def unpack(self, layer: Linear) -> Int4Grid:
        """``layer``'s parameters as a grid."""

    def params(self) -> tuple[str, ...]:
        return ('qweight', 'qzeros', 'scales')

    def check_shape(self, layer: Linear) -> None:
        if layer.out_features % 8 or layer.in_features % self.group_size:
            raise ValueError(f'a {type(self).__name__} layer needs outputs in multiples of 8 and inputs in '
                             f'groups of {self.group_size}, not {layer.out_features} x {layer.in_features}')

    def dequantize(self, layer: Linear) -> torch.Tensor:
        """``layer``'s ``W [N, K]`` in fp32."""
        return self.unpack(layer).dequantize(torch.float32)

    def make_kernel(self, layer: Linear, options: LinearOptions) -> LinearKernel:
        device = layer.qweight.device.type
        if options.dtype is not None and device == 'cuda':
            from lmdeploy.pytorch.nn.quant.w4a16_cuda import TritonW4A16Kernel
            kernel = TritonW4A16Kernel.of(self.unpack(layer))
        elif options.dtype == torch.bfloat16 and device == 'cpu' and self.group_size in TORCH_INT4_GROUP_SIZES:
            kernel = self.cpu_kernel(self.unpack(layer), layer.gate_up_panels, options.dtype)
        else:
            return ReferenceKernel(self, layer)
        for name in self.params():
            setattr(layer, name, None)
        return kernel

    @staticmethod
    def cpu_kernel(grid: Int4Grid, gate_up: bool, dtype: torch.dtype) -> LinearKernel:
        """A projection (a layer's or one expert's) for bf16 activations at every step size: the native int4 GEMV
        (a gate-and-up one with its SiLU-and-mul epilogue) where it is built and the shape fits its tiles, else
        torch's int4 kernel. One copy of the weight: the GEMV is ahead at one token, within about 15% either way
        above (``benchmark/w4_cpu.py``, ``benchmark/moe_w4_cpu.py``)."""
        return NativeInt4Kernel.of_grid(grid, gate_up) or TorchInt4Kernel.of_grid(grid, dtype)

    def make_expert_kernel(self, experts: FusedExperts, options: LinearOptions) -> ExpertKernel:
        device = experts.projection('down', 0).qweight.device.type
        if options.dtype is not None and device == 'cuda':
            from lmdeploy.pytorch.nn.quant.w4a16_cuda import TritonInt4ExpertKernel
            kernel = TritonInt4ExpertKernel.of(self, experts)
        elif options.dtype == torch.bfloat16 and device == 'cpu' and self.group_size in TORCH_INT4_GROUP_SIZES:
            kernels = {proj: [self.cpu_kernel(self.unpack(experts.projection(proj, e)), proj == 'gate_up',
                                                     options.dtype) for e in range(experts.num_experts)]
                       for proj in ('gate_up', 'down')}
            kernel = PerExpertKernel(experts.num_experts, lambda proj, expert: kernels[proj][expert])
        else:
            return PerExpertKernel(experts.num_experts,
                                   lambda proj, expert: ReferenceKernel(self, experts.projection(proj, expert)))
        experts.release()
        return kernel
