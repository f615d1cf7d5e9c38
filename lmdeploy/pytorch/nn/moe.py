"""Experts of a mixture-of-experts layer, stacked as 3-D weights and run by the fused-MoE kernel.

Under tensor parallelism each rank holds every expert's share of the intermediate features (gate and
up rows, down columns) and the ranks' partial outputs are summed.
"""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.distributed.parallel_state import Shard, current_group, split_range
from lmdeploy.pytorch.kernels import fused_moe
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU


class FusedExperts(nn.Module):
    """Every expert's MLP: ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]``, with
    ``I`` this rank's share of the intermediate size.

    With ``bias`` (gpt-oss) the experts also hold ``gate_up_bias [E, 2I]`` and ``down_bias [E, H]``; the
    down bias is added on the first rank only, before the ranks' outputs are summed. The activation is
    SiLU-and-mul, or ``activation`` when given.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, bias: bool = False,
                 activation: ClampedSwiGLU | None = None):
        super().__init__()
        self.tp = current_group()
        self.range = split_range(intermediate_size, self.tp.rank, self.tp.world_size)
        self.intermediate_size = size = self.range[1] - self.range[0]
        self.activation = activation
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, size), requires_grad=False)
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * size), requires_grad=False) if bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        down_bias = self.down_bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(fused_moe(x, self.gate_up, self.down, topk_weights, topk_ids, self.gate_up_bias,
                                            down_bias, self.activation))

    def expert_weight(self, expert: int, part: str,
                      kind: str = 'weight') -> tuple[torch.Tensor, str, str, Shard | None]:
        """The slice holding one expert's ``gate``, ``up`` or ``down`` weight (or bias, ``kind='bias'``), its
        parameter's name, the shard's label (see :meth:`weight_shards`) and the part of the checkpoint
        tensor that fills it."""
        size = self.intermediate_size
        bias = kind == 'bias'
        label = f'expert {expert} {part}' + (' bias' if bias else '')
        sharded = self.tp.world_size > 1
        if part == 'down':
            if bias:
                return self.down_bias[expert], 'down_bias', label, None
            return self.down[expert], 'down', label, Shard(1, *self.range) if sharded else None
        rows = slice(0, size) if part == 'gate' else slice(size, 2 * size)
        param = self.gate_up_bias if bias else self.gate_up
        shard = Shard(0, *self.range) if sharded else None
        return param[expert, rows], 'gate_up_bias' if bias else 'gate_up', label, shard

    def weight_shards(self) -> dict[str, list[str]]:
        """Each parameter's shards that the checkpoint must fill: every expert's gate, up and down (and
        their biases)."""
        experts = range(self.gate_up.shape[0])
        shards = {'gate_up': [f'expert {e} {part}' for e in experts for part in ('gate', 'up')],
                  'down': [f'expert {e} down' for e in experts]}
        if self.gate_up_bias is not None:
            shards.update({f'{name}_bias': [f'{label} bias' for label in labels] for name, labels in shards.items()})
        return shards

