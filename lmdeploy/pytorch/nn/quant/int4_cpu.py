"""4-bit weights for steps too small to keep a bf16 GEMM busy: they read a quarter of the bytes, which is what
a batch-1 decode step is bound by. A 4-bit copy of a bf16 weight (``decode_int4``) runs on the native GEMV
(``kernels/cpu/linear_int4.cpp``: fp16 scale and minimum per group of 32, as GGUF's Q4_1) where it was built,
else on torch's int4 kernel (``_weight_int4pack_mm_for_cpu``). The grid of a 4-bit checkpoint (AWQ, GPTQ) runs
as it is on the native GEMV at every step (on torch's int4 kernel where the GEMV is not built)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel
from lmdeploy.pytorch.weights.derived_cache import cached_derivation
from lmdeploy.pytorch.step_context import small_step

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.quant.w4a16 import Int4Grid

INT4_GROUP = 32
INT4_TILE = 16  # rows per tile of the native GEMV
LEAST_SQUARES_CHUNK = 1 << 17  # weights fitted at a time by least_squares_grid
# Steps of more tokens run faster on bf16 weights: with the native GEMM, or with oneDNN's.
INT4_MAX_TOKENS_NATIVE_GEMM = 2
INT4_MAX_TOKENS_ONEDNN = 8
TORCH_INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's int4 CPU kernel accepts


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


def grid_packed(grid: Int4Grid, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's grid (inputs in group order) as the int4 kernel's packed codes and
    ``scales_and_zeros [K / G, N, 2]`` in ``dtype`` (the activations'): ``q * s - o = (q - 8) * s + (8 * s - o)``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(grid.codes.to(torch.int32).contiguous(), 2)
    scales = grid.scales.float()
    scales_and_zeros = torch.stack((scales, 8 * scales - grid.offsets), dim=-1).to(dtype)
    return packed, scales_and_zeros.contiguous()


class TorchInt4Kernel(LinearKernel):
    """torch's int4 kernel on its packed codes and ``scales_and_zeros``; with ``order``, the weight's inputs
    are in that order (act-order checkpoints), and so are ``x``'s first."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = INT4_GROUP,
                 order: torch.Tensor | None = None):
        self.packed, self.scales_and_zeros, self.group_size, self.order = packed, scales_and_zeros, group_size, order

    @classmethod
    def of_grid(cls, grid: Int4Grid, dtype: torch.dtype) -> TorchInt4Kernel:
        """A checkpoint's grid for activations in ``dtype`` (bf16): its scale and ``8 * scale - offset`` rounded
        to ``dtype``, as the kernel takes them."""
        grid, order = grid.in_group_order()
        return cls(*grid_packed(grid, dtype), grid.group_size, order)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.order is not None:
            x = x[:, self.order]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return out if bias is None else out + bias

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        native = cpu.native()
        if native is None or self.order is not None:  # the stack takes no input order
            return None
        return native.Projection(kind='int4_torch', weight=self.packed, scale=self.scales_and_zeros, bias=bias)


class NativeInt4Kernel(LinearKernel):
    """The native AVX512-BF16 GEMV on 4-bit groups (``kernels/cpu/linear_int4.cpp``, from :func:`pack_int4`);
    a gate-and-up layer's tiles alternate gate and up rows, so that SiLU-and-mul runs in its epilogue. With
    ``order``, the weight's inputs are in that order (act-order checkpoints), and so are ``x``'s first."""

    kind = 'int4'  # the native kernels' ``{kind}_linear`` and ``{kind}_gate_up_silu``, the stack's projection kind

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, gate_up: bool, order: torch.Tensor | None = None):
        self.packed, self.scales, self.gate_up, self.order = packed, scales, gate_up, order

    @classmethod
    def of_grid(cls, grid: Int4Grid, gate_up: bool = False) -> NativeInt4Kernel | None:
        """A checkpoint's grid as it is, in groups of a multiple of 32 inputs: its scales, and its offsets
        negated, in fp16 (an fp16 or bf16 scale exactly, an offset within half an fp16 step); None where the
        GEMV is not built or the shape does not fit its tiles."""
        rows = 2 * INT4_TILE if gate_up else INT4_TILE
        if cpu.int4_gemv() is None or grid.group_size % INT4_GROUP or grid.codes.shape[0] % rows:
            return None
        grid, order = grid.in_group_order()
        repeat = grid.group_size // INT4_GROUP
        scale = grid.scales.T.float().repeat_interleave(repeat, dim=1).half()
        minimum = (-grid.offsets.T).repeat_interleave(repeat, dim=1).half()
        return cls(*pack_int4(grid.codes.to(torch.uint8), scale, minimum, gate_up), gate_up, order)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.order is not None:
            x = x[:, self.order]
        linear = getattr(cpu.native(), f'{self.kind}_linear')
        if not self.gate_up:
            return linear(x, self.packed, self.scales, bias)
        tiles = linear(x, self.packed, self.scales, None)  # gate and up tiles alternate
        out = tiles.unflatten(-1, (-1, 2, INT4_TILE)).transpose(-3, -2).flatten(-3)
        return out if bias is None else out + bias

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if not self.gate_up or bias is not None:
            return None
        return getattr(cpu.native(), f'{self.kind}_gate_up_silu')(x if self.order is None else x[:, self.order],
                                                                  self.packed, self.scales)

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        if (self.gate_up and bias is not None) or self.order is not None:  # the stack runs neither
            return None
        return cpu.native().Projection(kind=self.kind, weight=self.packed, scale=self.scales, bias=bias)


def least_squares_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as codes ``[N, K]`` (0..15, each group of 32 inputs' min/max grid) and the fp16
    ``scale``, ``minimum [N, K / 32]`` that fit the group best (least squares) for those codes: a GGUF Q4_1
    group, loaded in bf16, comes back with its codes, and its scale and minimum within about an fp16 step of
    the file's (closer to the file's weights than the bf16 copy). Fitted a few hundred KB of rows at a time, whose
    temporaries stay in cache (about 3x faster at a model's start than the whole weight at once); a group's fit
    depends on that group alone."""
    out_features, in_features = weight.shape
    codes = torch.empty(out_features, in_features, dtype=torch.uint8)
    scale, minimum = (torch.empty(out_features, in_features // INT4_GROUP, dtype=torch.half) for _ in range(2))
    rows = max(1, LEAST_SQUARES_CHUNK // in_features)
    for start in range(0, out_features, rows):
        end = min(start + rows, out_features)
        codes[start:end], scale[start:end], minimum[start:end] = _fit_groups(weight[start:end])
    return codes, scale, minimum


def _fit_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - low[..., None]) / step[..., None]).round_().clamp_(0, 15)
    n, sum_q, sum_w = INT4_GROUP, codes.sum(-1), groups.sum(-1)
    spread = n * codes.square().sum(-1) - sum_q.square()
    fitted = (n * (codes * groups).sum(-1) - sum_q * sum_w) / spread.clamp_min(1)
    scale = torch.where(spread > 0, fitted, step)
    minimum = torch.where(spread > 0, (sum_w - scale * sum_q) / n, low)
    return codes.to(torch.uint8).view(out_features, in_features), scale.half(), minimum.half()


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` (0..15) and fp16 ``scale``, ``minimum [N, K / 32]`` in the native GEMV's layout
    (see ``linear_int4.cpp``): ``packed [N/16, K/32, 8, 32]`` uint8 and ``scales [N/16, K/32, 2, 16]``
    fp16. With ``gate_up`` (gate then up rows) the 16-row tiles alternate gate and up."""
    out_features, in_features = codes.shape
    if gate_up:
        order = gate_up_order(out_features)
        scale, minimum = scale[order], minimum[order]
    tiles, groups = out_features // INT4_TILE, in_features // INT4_GROUP
    scales = torch.stack((scale, minimum)).view(2, tiles, INT4_TILE, groups).permute(1, 3, 0, 2).contiguous()
    return pack_int4_codes(codes, gate_up), scales


def gate_up_order(rows: int) -> torch.Tensor:
    """The rows of a [gate; up] weight with its 16-row tiles alternating gate and up."""
    return torch.arange(rows).view(2, -1, INT4_TILE).transpose(0, 1).flatten()


def pack_int4_codes(codes: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """Codes ``[N, K]`` (0..15) as the native GEMV's ``packed [N/16, K/32, 8, 32]`` uint8 (see :func:`pack_int4`)."""
    out_features, in_features = codes.shape
    if gate_up:
        codes = codes[gate_up_order(out_features)]
    tiles, groups = out_features // INT4_TILE, in_features // INT4_GROUP
    # input 16 h + 2 c + b of a group: chunk c, byte 2 * row + b, low nibble for h = 0, high for h = 1
    nibbles = codes.view(tiles, INT4_TILE, groups, 2, 8, 2).permute(0, 2, 4, 1, 5, 3)
    return (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(tiles, groups, 8, 2 * INT4_TILE).contiguous()


class SmallStepInt4Kernel(LinearKernel):
    """Small steps on a kernel for few rows (``small``: a 4-bit copy, or a GGUF layer's GEMV), the others on
    ``large`` (all steps without one): in an engine step, decode rows are small steps and prefill rows not,
    outside one, steps of at most ``small_step_rows`` tokens (see :func:`~lmdeploy.pytorch.step_context.small_step`)."""

    def __init__(self, small: LinearKernel, small_step_rows: int, large: LinearKernel | None = None):
        self.small, self.small_step_rows, self.large = small, small_step_rows, large

    @classmethod
    def of(cls, weight: torch.Tensor, gate_up: bool = False) -> SmallStepInt4Kernel | None:
        """The 4-bit copy of a bf16 CPU weight (without its kernel for larger steps), on the native GEMV
        where it was built (``gate_up``: gate then up rows, for its SiLU-and-mul epilogue; its fitted grid is
        kept in the derived-weight cache, see ``weights/derived_cache.py``), else on torch's int4 kernel; None
        for other weights."""
        if weight.dtype != torch.bfloat16 or weight.device.type != 'cpu' or weight.shape[1] % INT4_GROUP:
            return None
        rows = INT4_MAX_TOKENS_NATIVE_GEMM if cpu.bf16_gemm() else INT4_MAX_TOKENS_ONEDNN
        if cpu.int4_gemv() is not None and weight.shape[0] % (2 * INT4_TILE if gate_up else INT4_TILE) == 0:
            packed = cached_derivation(f'int4 least squares gate_up={gate_up}', weight, __file__,
                                       lambda: pack_int4(*least_squares_grid(weight), gate_up))
            return cls(NativeInt4Kernel(*packed, gate_up), rows)
        return cls(TorchInt4Kernel(*int4_groups(weight)), rows)

    def over(self, large: LinearKernel) -> SmallStepInt4Kernel:
        """This copy for small steps with ``large`` for the others."""
        return SmallStepInt4Kernel(self.small, self.small_step_rows, large)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.large is not None and not small_step(x.shape[0], self.small_step_rows):
            return self.large(x, bias)
        return self.small(x, bias)

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if self.large is not None and not small_step(x.shape[0], self.small_step_rows):
            return self.large.gate_up_silu(x, bias)
        return self.small.gate_up_silu(x, bias)

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return None if self.large is None else self.large.native_projection(bias)

    def small_step_projection(self, bias: torch.Tensor | None) -> object | None:
        return self.small.native_projection(bias)

    def expert_projection(self, bias: torch.Tensor | None, small_step: bool) -> object | None:
        kernel = self.small if small_step or self.large is None else self.large
        return kernel.native_projection(bias)
