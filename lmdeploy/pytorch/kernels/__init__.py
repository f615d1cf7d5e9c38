"""Compute kernels behind one interface: a CUDA tensor goes to the Triton kernel in ``kernels/cuda``,
a CPU tensor to the native kernel in ``kernels/cpu`` where there is one (and it built), anything else
to the torch version, which runs everywhere and is the reference."""
from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator

import torch

from lmdeploy.pytorch.kernels import (activation, attention, cpu, gated_delta, mamba1, mla, moe, norm, rotary, sampling,
                                     w8a8)


_triton_on_cpu = False


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Within it, CPU tensors go to the Triton kernels too: with ``TRITON_INTERPRET=1`` set before triton is first
    imported, an engine on the CPU in fp32 then runs the CUDA path's kernels in Triton's interpreter, which checks
    how the engine calls them (layouts, block tables, windows, sinks, quantized caches) without a GPU."""
    global _triton_on_cpu
    before, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = before


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels serve ``tensor``: on CUDA, and any tensor within :func:`triton_on_cpu`."""
    return tensor.is_cuda or _triton_on_cpu


def dispatch(torch_fn: Callable, native_cpu: str | None = None, built_for_cpu: str = 'native',
             triton: bool = True) -> Callable:
    """Wraps ``torch_fn`` so that a CUDA first argument (any, within :func:`triton_on_cpu`) runs
    ``kernels.cuda.<same name>`` instead (unless ``triton`` is False), and a CPU one the native kernel ``native_cpu`` when given and built: when
    ``kernels.cpu.<built_for_cpu>()`` returns the kernels (``gated_delta``: only where the AVX-512 path was built).

    The Triton module is imported on the first CUDA call, so CPU-only installs never need triton.
    """
    name = torch_fn.__name__

    @functools.wraps(torch_fn)
    def run(first: torch.Tensor, *args, **kwargs):
        if triton and triton_runs_on(first):
            return getattr(importlib.import_module('lmdeploy.pytorch.kernels.cuda'), name)(first, *args, **kwargs)
        module = getattr(cpu, built_for_cpu)() if native_cpu and first.device.type == 'cpu' else None
        if module is not None:
            return getattr(module, native_cpu)(first, *args, **kwargs)
        return torch_fn(first, *args, **kwargs)

    return run


apply_rotary = dispatch(rotary.apply_rotary, native_cpu='apply_rotary')
argmax = dispatch(sampling.argmax, native_cpu='argmax')
decode_attention = dispatch(attention.decode_attention, native_cpu='paged_decode_attention')
fill_kv_cache = dispatch(attention.fill_kv_cache, native_cpu='fill_kv_cache')
fused_moe = dispatch(moe.fused_moe)
causal_conv1d_decode = dispatch(gated_delta.causal_conv1d_decode, native_cpu='causal_conv1d_decode', triton=False)
gated_delta_decode = dispatch(gated_delta.gated_delta_decode, native_cpu='gated_delta_decode',
                              built_for_cpu='gated_delta')
mamba1_scan = dispatch(mamba1.mamba1_scan, native_cpu='mamba1_scan', built_for_cpu='mamba1_scan', triton=False)
moe_routing = dispatch(moe.moe_routing)
prefill_attention = dispatch(attention.prefill_attention, native_cpu='paged_prefill_attention')
rms_norm = dispatch(norm.rms_norm, native_cpu='rms_norm')
silu_and_mul = dispatch(activation.silu_and_mul, native_cpu='silu_and_mul')
w8a8_linear = dispatch(w8a8.w8a8_linear)
fill_latent_cache = dispatch(mla.fill_latent_cache)
mla_decode_attention = dispatch(mla.mla_decode_attention, native_cpu='mla_decode_attention')
mla_prefill_attention = dispatch(mla.mla_prefill_attention, native_cpu='mla_prefill_attention')
grouped_topk = moe.grouped_topk  # torch's own kernels, on every device
group_limited_topk = moe.group_limited_topk
biased_softmax_topk = moe.biased_softmax_topk

__all__ = ['apply_rotary', 'argmax', 'decode_attention', 'dispatch', 'triton_on_cpu', 'triton_runs_on', 'fill_kv_cache',
           'fused_moe', 'moe_routing',
           'prefill_attention', 'rms_norm', 'silu_and_mul', 'w8a8_linear', 'fill_latent_cache',
           'mla_decode_attention', 'mla_prefill_attention', 'grouped_topk', 'group_limited_topk',
           'biased_softmax_topk', 'causal_conv1d_decode', 'gated_delta_decode', 'mamba1_scan']
