"""Native CPU kernels, compiled on first use with ``torch.utils.cpp_extension`` (about 40 s, then
cached under ``~/.cache/torch_extensions``). Without a C++ compiler, or with
``LMDEPLOY_CPU_KERNELS=0``, the torch versions run instead."""
from __future__ import annotations

import logging
import os
import threading
from types import ModuleType

import torch

logger = logging.getLogger('lmdeploy')
_SOURCES = ['bindings.cpp', 'paged_attention.cpp', 'paged_attention_avx512.cpp', 'paged_prefill_avx512.cpp',
            'elementwise.cpp', 'fill_kv_cache.cpp', 'linear_bf16.cpp', 'threads.cpp', 'decoder_stack.cpp']
_FLAGS = ['-O3', '-march=native', '-fopenmp', '-ffast-math']
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_this_thread = threading.local()


def native() -> ModuleType | None:
    """The compiled kernels (building them the first time), or None when they are unavailable."""
    if 'module' in _loaded:  # every kernel call asks: no lock once loaded
        return _loaded['module']
    with _lock:
        if 'module' not in _loaded:
            _loaded['module'] = _build()
        return _loaded['module']


def bf16_gemm() -> ModuleType | None:
    """The kernels when their ``bf16_linear`` should run this machine's bf16 linear layers: built with
    AVX512-BF16, on a CPU without AMX (whose oneDNN GEMMs are several times faster); else None."""
    module = native()
    if module is None or not module.bf16_gemm_available():
        return None
    return None if getattr(torch.cpu, '_is_amx_tile_supported', lambda: False)() else module


def bind_worker_threads() -> None:
    """Pins the calling thread's OpenMP worker threads to one CPU each, as vLLM's CPU backend pins its
    threads; the caller itself stays free, so threads it starts later are not pinned. Once per calling
    thread and thread count; ``LMDEPLOY_CPU_BIND=0`` turns it off. Unpinned, a worker that the OS
    moves or shares a CPU with the main thread stalls every barrier: offline throughput measured
    5-7% lower and more variable on the 2-core machine."""
    threads = torch.get_num_threads()
    if (getattr(_this_thread, 'bound_threads', None) == threads or os.environ.get('LMDEPLOY_CPU_BIND', '1') == '0'
            or not hasattr(os, 'sched_getaffinity')):
        return
    _this_thread.bound_threads = threads
    module = native()
    cpus = sorted(os.sched_getaffinity(0))
    if module is not None and threads <= len(cpus):
        module.bind_worker_threads(cpus)


def _build() -> ModuleType | None:
    if os.environ.get('LMDEPLOY_CPU_KERNELS', '1') == '0':
        return None
    from torch.utils.cpp_extension import load
    here = os.path.dirname(__file__)
    logger.info('loading the native CPU kernels (the first time they are compiled, about 40 s)')
    try:
        return load('lmdeploy_cpu_kernels', [os.path.join(here, name) for name in _SOURCES], extra_cflags=_FLAGS,
                    extra_ldflags=['-fopenmp'])
    except Exception as exc:  # no compiler, no headers, ...: fall back to torch, loudly
        logger.warning('native CPU kernels unavailable (%s: %s); using the torch versions', type(exc).__name__, exc)
        return None
