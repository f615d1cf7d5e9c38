"""Host-to-device copies that never wait for the device."""
from __future__ import annotations

import torch


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
