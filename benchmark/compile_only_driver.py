"""A stand-in for Triton's CUDA driver on a machine without a GPU: launches compile for its target."""
from triton.backends.compiler import GPUTarget


class CompileOnlyDriver:
    """What ``JITFunction.run`` asks of the active driver, for a device that is not there."""

    def __init__(self, capability: int):
        self.target = GPUTarget('cuda', capability, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0
