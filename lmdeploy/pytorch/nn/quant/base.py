"""What a weight format is: the parameters a checkpoint fills (:class:`WeightFormat`) and the kernel
that multiplies by them once they are loaded (:class:`LinearKernel`)."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
    from lmdeploy.pytorch.nn.linear import Linear
    from lmdeploy.pytorch.nn.moe import FusedExperts
    from lmdeploy.pytorch.weights.safetensors_loader import WeightSource


@dataclass(frozen=True)
class Layout:
    """Which dimension of a parameter runs along its layer's outputs and inputs (None: neither), and
    how many features one index of it covers (packed codes, one scale per group): what tensor
    parallelism and merged layers slice."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    outputs_per_index: int = 1
    inputs_per_index: int = 1


def new_parameter(shape: tuple[int, ...], layout: Layout, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialized parameter of ``layout``. One with an explicit ``dtype`` keeps it when the model is
    cast to its dtype (scales in fp32, integer codes)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.linear_layout = layout
    param.keep_dtype = dtype is not None
    return param


def layout_of(param: torch.Tensor) -> Layout:
    return getattr(param, 'linear_layout', Layout())


@dataclass(frozen=True)
class LinearOptions:
    """How to lay out a loaded weight: ``pack_cpu`` for the CPU GEMMs (bf16 on the CPU), and
    ``small_step_int4`` for a 4-bit copy that steps of a few tokens run on (bf16 on the CPU). ``dtype``
    is the model's, given once the weights are loaded (None at construction, when quantized formats'
    kernels read their parameters as they are)."""

    pack_cpu: bool = False
    small_step_int4: bool = False
    dtype: torch.dtype | None = None


class LinearKernel(ABC):
    """A linear layer's loaded weight, in the layout of the kernel that multiplies by it."""

    # Steps of at most this many tokens run on another copy of the weight (see SmallStepInt4Kernel).
    small_step_rows = 0

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias``."""

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a gate-and-up layer in one kernel, or None when this kernel has no such
        epilogue (the layer then applies it)."""
        return None

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        """The layer as a ``Projection`` of the native decoder stack (its weight as a native GEMM takes it,
        named), or None when no native GEMM runs this kernel."""
        return None

    def small_step_projection(self, bias: torch.Tensor | None) -> object | None:
        """The layer as a ``Projection`` for steps of at most ``small_step_rows`` tokens: the
        :meth:`native_projection` of a kernel that runs every step on one copy of its weight."""
        return self.native_projection(bias)

    def expert_projection(self, bias: torch.Tensor | None, small_step: bool) -> object | None:
        """One expert's projection as a ``Projection`` of a MoE block in the native stack, for its share of a
        step, whatever its size: in the stack of small steps (``small_step``: decode rows, see
        :func:`~lmdeploy.pytorch.step_context.small_step`) its kernel for small steps, in the other its kernel for
        large ones; the :meth:`native_projection` of a kernel that runs every step on one copy."""
        return self.native_projection(bias)

    def router_projection(self, bias: torch.Tensor | None) -> object | None:
        """A MoE block's router or shared-expert gate, or another projection of a few outputs, as a ``Projection``
        of the native stack: its :meth:`native_projection`, or torch's int8 GEMM's where the int8 GEMM's panels do
        not fit the rows (:class:`~lmdeploy.pytorch.nn.quant.w8a8.W8A8Kernel`)."""
        return self.native_projection(bias)


class ExpertKernel(ABC):
    """The loaded weights of a mixture-of-experts layer's experts, in the layout of the kernel that runs them."""

    # An expert's share of a step runs on a kernel of its own for small steps (as LinearKernel's) outside an engine
    # step up to this many rows, in one for its decode rows whatever their number; 0: one kernel.
    small_step_rows = 0

    @abstractmethod
    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                 activation: ClampedSwiGLU | None) -> torch.Tensor:
        """``sum_j w[t, j] * down_e(act(gate_up_e(x[t])))`` with ``e = topk_ids[t, j]`` (see ``fused_moe``)."""

    def native_experts(self, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                       small_step: bool = False) -> dict[str, object] | None:
        """The experts as a ``MoEBlock`` of the native stack takes them (its ``gate_up`` and ``down`` with their
        ``gate_up_bias`` and ``down_bias``, or its ``expert_gate_up`` and ``expert_down`` each with its expert's
        share of them; by name), or None when no native kernel runs them; ``small_step``: for the stack of small
        steps (see :meth:`LinearKernel.expert_projection`)."""
        return None


class WeightFormat(ABC):
    """How a checkpoint stores linear weights: the parameters it fills and the kernel run on them. The
    experts of a mixture-of-experts layer hold each projection's parameters stacked over the experts
    (see :class:`~lmdeploy.pytorch.nn.moe.FusedExperts`) and run on :meth:`make_expert_kernel`'s kernel."""

    split_granule = 1  # inputs that a tensor-parallel share keeps together (an MLP's or the experts' down)
    # the GGML block type the token embedding's table is held in (a GGUF file's); None: the model's dtype
    embedding_block_type: str | None = None

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Registers ``layer``'s checkpoint parameters for its ``in_features`` x ``out_features`` (the
        bias is the layer's own)."""

    @abstractmethod
    def make_kernel(self, layer: Linear, options: LinearOptions) -> LinearKernel:
        """The kernel for ``layer``'s parameters, which it reads as they are then (loaded or not). A kernel
        that keeps its own copy of the weight sets the layer's parameters to None."""

    def layer_format(self, name: str, layer: Linear | FusedExperts) -> WeightFormat:
        """The format of the linear layer or the experts ``name`` (its name in the model, as built in this
        one): this one, unless the checkpoint holds its layers in different formats (a GGUF file of mixed
        types)."""
        return self

    def expert_format(self, proj: str) -> WeightFormat:
        """The format whose ``create_weights`` gives the parameters of one expert's ``gate_up`` or ``down``
        projection: this one, unless the experts' projections differ (a GGUF layer's Q4_K gate and up beside a
        Q6_K down)."""
        return self

    def make_expert_kernel(self, experts: FusedExperts, options: LinearOptions) -> ExpertKernel:
        """The kernel for ``experts``' parameters, which it reads as they are then (like :meth:`make_kernel`)."""
        raise ValueError(f'mixture-of-experts layers of {type(self).__name__} checkpoints are not supported')

    def lm_head_kernel(self, table: torch.Tensor) -> LinearKernel | None:
        """The kernel of an LM head over ``table [vocab, hidden]`` (the model's dtype, on the model's device; the
        embedding's when tied, which keeps it) in a model of this format, for every step size (fp32 logits on the
        CPU); None: the table's own GEMM."""
        return None

    def convert_checkpoint(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """The checkpoint's ``(name, tensor)`` pairs as the model loads them: a format that stores some
        tensors in another form converts them here (MXFP4 experts); the others pass them through."""
        return iter(weights)


_FORMATS: dict[str, type[WeightFormat]] = {}


def register_format(quant_method: str):
    """Class decorator: the format of checkpoints whose ``quantization_config`` names ``quant_method``;
    the class is built as ``cls.from_config(quantization_config)``."""

    def register(cls: type[WeightFormat]) -> type[WeightFormat]:
        _FORMATS[quant_method] = cls
        return cls

    return register


def weight_format_for(quantization_config: dict | None) -> WeightFormat:
    """The format of a checkpoint with this ``quantization_config`` (None: weights in the model dtype)."""
    from lmdeploy.pytorch.nn.quant.dense import DenseFormat
    if not quantization_config:
        return DenseFormat()
    method = quantization_config.get('quant_method')
    if method not in _FORMATS:
        raise ValueError(f'quantization method {method!r} is not supported; supported: {sorted(_FORMATS)}')
    return _FORMATS[method].from_config(quantization_config)


_current: WeightFormat | None = None


def current_weight_format() -> WeightFormat:
    """The format linear layers constructed now take (weights in the model dtype outside
    :func:`use_weight_format`)."""
    return _current if _current is not None else weight_format_for(None)


@contextlib.contextmanager
def use_weight_format(weight_format: WeightFormat) -> Iterator[WeightFormat]:
    """Makes ``weight_format`` current while a model is built."""
    global _current
    previous, _current = _current, weight_format
    try:
        yield weight_format
    finally:
        _current = previous


_deferred = False


@contextlib.contextmanager
def defer_weights() -> Iterator[None]:
    """While a model is built: linear layers and MoE experts hold their format's parameters on the meta device
    (no memory, no address space) until ``set_weight_format`` gives each the format its name picks (a GGUF
    file's layers differ in type), so that no layer reserves parameters of a format it will not hold."""
    global _deferred
    previous, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = previous


def weights_device() -> contextlib.AbstractContextManager:
    """Where a layer's ``set_weight_format`` creates its format's parameters: on the meta device within
    :func:`defer_weights`, else on the default device."""
    return torch.device('meta') if _deferred else contextlib.nullcontext()


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` for its floating-point tensors, except parameters that keep their dtype
    (:func:`new_parameter`)."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and not getattr(param, 'keep_dtype', False):
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)
    return model
