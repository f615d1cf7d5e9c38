"""A stacked layer (q/k/v, gate/up) whose parts a checkpoint holds in different formats (a GGUF Q4_K_M file's
Q4_K ``q_proj`` and ``k_proj`` beside a Q6_K ``v_proj``): each part on its own kernel, the outputs side by side
in the stacked layer's output; in the native decoder stack a ``Projection`` of the parts' projections."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel


class PartsKernel(LinearKernel):
    """``x @ W.T + bias`` of a stacked layer as its parts' kernels give it, part ``i`` for ``sizes[i]`` outputs;
    steps of at most ``small_step_rows`` tokens (the largest of the parts') run on each part's small-step
    weights in the native decoder stack (a part picks its own copy in :meth:`__call__`)."""

    def __init__(self, parts: list[LinearKernel], sizes: list[int]):
        self.parts, self.sizes = parts, sizes
        self.small_step_rows = max(part.small_step_rows for part in parts)

    def _biases(self, bias: torch.Tensor | None) -> list[torch.Tensor | None]:
        return [None] * len(self.parts) if bias is None else list(bias.split(self.sizes))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.cat([part(x, b) for part, b in zip(self.parts, self._biases(bias))], dim=-1)

    def _projection(self, projections: list[object | None]) -> object | None:
        if any(projection is None for projection in projections):
            return None
        return cpu.native().Projection(parts=projections)

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return self._projection([part.native_projection(b) for part, b in zip(self.parts, self._biases(bias))])

    def small_step_projection(self, bias: torch.Tensor | None) -> object | None:
        return self._projection([part.small_step_projection(b) for part, b in zip(self.parts, self._biases(bias))])
