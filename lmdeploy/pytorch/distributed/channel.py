"""How rank 0 hands each step's inputs to the other tensor-parallel ranks: one pickled message per
step, broadcast over the group's CPU process group (a fixed-size header, then the payload)."""
from __future__ import annotations

import dataclasses
import io
import pickle
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from lmdeploy.pytorch.distributed.parallel_state import TPGroup

HEADER = 2  # int64s: message kind, payload bytes
MESSAGE, STOP = 1, 2
# A rank waits for rank 0's next step as long as the engine sits idle.
IDLE_TIMEOUT = timedelta(days=365)


class _Pickler(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays (several times cheaper than torch's own reduction)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == 'cpu':
            try:
                return torch.from_numpy, (np.ascontiguousarray(obj.numpy()),)
            except TypeError:  # a dtype numpy lacks (bfloat16): torch's own reduction
                pass
        return NotImplemented


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (through lists, tuples, dicts and dataclasses) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(item, device) for item in obj)
    if isinstance(obj, dict):
        return {key: to_device(value, device) for key, value in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


class StepChannel:
    """Rank 0 :meth:`send`\\ s; every other rank :meth:`recv`\\ s the same messages in order."""

    def __init__(self, group: TPGroup):
        self.group = group

    def send(self, message: Any) -> None:
        """Hands ``message`` (tensors anywhere in it go through the host) to the other ranks."""
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(to_device(message, torch.device('cpu')))
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        self.group.broadcast(torch.tensor([MESSAGE, payload.numel()], dtype=torch.int64))
        self.group.broadcast(payload)

    def stop(self) -> None:
        """Tells the other ranks that no message follows."""
        self.group.broadcast(torch.tensor([STOP, 0], dtype=torch.int64))

    def recv(self) -> Any | None:
        """The next message rank 0 sent, or None once it said stop."""
        header = torch.empty(HEADER, dtype=torch.int64)
        self.group.broadcast(header, timeout=IDLE_TIMEOUT)
        kind, size = header.tolist()
        if kind == STOP:
            return None
        payload = torch.empty(size, dtype=torch.uint8)
        self.group.broadcast(payload)
        return pickle.loads(payload.numpy().tobytes())
