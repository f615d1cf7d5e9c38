"""Fixed-size recurrent state per sequence, for models with linear-attention layers (Gated DeltaNet).

Such a layer keeps no KV cache: each sequence carries a convolution state ``[conv_dim, kernel - 1]`` (the
layer's last inputs) and a delta-rule state ``[heads, k_dim, v_dim]`` (fp32) from token to token. The runner
holds, for each of those layers, one tensor of each kind with a row per slot (see :func:`allocate_states`);
the :class:`StatePool` hands out the slots. A sequence takes a slot when the scheduler first admits it and gives
it back when it finishes, is aborted or fails, and when it is preempted (it is then recomputed from its first
token, its state from zero: a prefill chunk that starts at position 0 ignores what the slot held).
"""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.engine.sequence import Sequence

# per layer: the shape and dtype of each state tensor of one slot, or None for a layer with a KV cache ([] for a
# layer with neither: Nemotron-H's MLP blocks; a KVAndStates for a layer with both)
StateShapes = list[list[tuple[tuple[int, ...], torch.dtype]] | None]


class KVAndStates(list):
    """The state shapes of a layer that also attends over the paged KV cache (Falcon-H1: attention and Mamba-2 side
    by side in every layer): its place in ``kv_caches`` holds the KV cache's tensors, then its states."""


class StatePool:
    """``num_slots`` recurrent-state slots; :meth:`take` one for a sequence, :meth:`give_back` it when done."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f'a recurrent-state pool needs at least one slot, got {num_slots}')
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq: Sequence) -> None:
        """Gives ``seq`` a free slot (``seq.state_slot``); the caller checks :attr:`num_free` first."""
        if seq.state_slot is not None:
            raise RuntimeError(f'sequence {seq.seq_id} already holds state slot {seq.state_slot}')
        if not self._free:
            raise RuntimeError('no free recurrent-state slot')
        seq.state_slot = self._free.pop()

    def give_back(self, seq: Sequence) -> None:
        """Returns the slot of ``seq``, if it holds one; idempotent."""
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None


def recurrent_state_shapes(model: nn.Module, num_layers: int) -> StateShapes:
    """Each layer's state shapes (see :data:`StateShapes`): the model's ``recurrent_state_shapes()``, or None
    for every layer of a model without recurrent layers."""
    shapes = getattr(model, 'recurrent_state_shapes', None)
    return shapes() if shapes is not None else [None] * num_layers


def state_bytes_per_slot(shapes: StateShapes) -> int:
    """Bytes one slot takes across all layers."""
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
               for layer in shapes if layer for shape, dtype in layer)


def allocate_states(shapes: list[tuple[tuple[int, ...], torch.dtype]], num_slots: int,
                    device: torch.device) -> tuple[torch.Tensor, ...]:
    """One layer's state tensors, ``[num_slots, *shape]`` each, zeroed."""
    return tuple(torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in shapes)
