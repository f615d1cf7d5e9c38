"""Experts of a mixture-of-experts layer, stacked as 3-D weights and run by the fused-MoE kernel."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.kernels import fused_moe


class FusedExperts(nn.Module):
    """Every expert's MLP: ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.gate_up, self.down, topk_weights, topk_ids)

    def expert_weight(self, expert: int, part: str) -> tuple[torch.Tensor, str, str]:
        """The slice holding one expert's ``gate``, ``up`` or ``down`` weight, its parameter's name and
        the shard's label (see :meth:`weight_shards`)."""
        size = self.intermediate_size
        label = f'expert {expert} {part}'
        if part == 'down':
            return self.down[expert], 'down', label
        rows = slice(0, size) if part == 'gate' else slice(size, 2 * size)
        return self.gate_up[expert, rows], 'gate_up', label

    def weight_shards(self) -> dict[str, list[str]]:
        """Each parameter's shards that the checkpoint must fill: every expert's gate, up and down."""
        experts = range(self.gate_up.shape[0])
        return {'gate_up': [f'expert {e} {part}' for e in experts for part in ('gate', 'up')],
                'down': [f'expert {e} down' for e in experts]}
