"""Host-to-device copies that never wait for the device, and zeroed host memory that costs nothing until used."""
from __future__ import annotations

import math
import mmap

import torch


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU it lies in an anonymous mapping of its own, which the OS fills with zero pages
    as they are first touched, so a large KV cache costs nothing at start and only the memory it uses (the
    same zeros as ``torch.zeros``, which writes every byte at once)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != 'cpu' or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the mapping


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; a CUDA copy goes through pinned memory, asynchronously (a plain copy from
    pageable memory would wait for every kernel queued before it)."""
    if device.type == 'cpu':
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors on their way to (pinned) host memory; :meth:`wait` returns them once they are there."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.event = None
        self.host = tensors
        if tensors and tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host
