"""Native CPU kernels, compiled on first use with ``torch.utils.cpp_extension`` (about a minute on two
cores, once; the build is cached under ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``).
Without a C++ compiler, or with ``LMDEPLOY_CPU_KERNELS=0``, the torch versions run instead.

The build targets the CPU it runs on (``-march=native``), so the cached build is named after what it is
built from (``lmdeploy_cpu_kernels_<hash>``, see :func:`build_name`): the lmdeploy and torch versions, the
sources and their folder, and the CPU flags ``-march=native`` stands for. Two checkouts or venvs never overwrite or wait on
each other's build, and a cache shared by machines with different CPUs (a network home, a container
image) holds one build per CPU kind instead of handing one machine's instructions to another (SIGILL).

While it compiles, a line on stderr says so and counts the compiled translation units."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from types import ModuleType

import torch

logger = logging.getLogger('lmdeploy')
_SOURCES = ['bindings.cpp', 'paged_attention.cpp', 'paged_attention_avx512.cpp', 'paged_attention_quant_avx512.cpp',
            'paged_prefill_avx512.cpp', 'elementwise.cpp', 'fill_kv_cache.cpp', 'linear_bf16.cpp', 'linear_int8.cpp',
            'threads.cpp', 'decoder_stack.cpp', 'mla.cpp', 'linear_int4.cpp', 'linear_q8.cpp',
            'linear_q6k.cpp', 'linear_q5k.cpp', 'moe_block.cpp', 'linear_mxfp4.cpp', 'gated_delta.cpp',
            'mla_layer.cpp', 'linear_attention.cpp', 'dequantized_linear.cpp', 'moe_block_region.cpp',
            'linear_fp32.cpp', 'mamba1.cpp']
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
    return None if onednn_amx() else module


def onednn_amx() -> bool:
    """Whether this CPU has AMX tiles, on which oneDNN runs bf16 GEMMs several times faster than on AVX-512 code
    (torch's answer from the CPU itself: ``ONEDNN_MAX_CPU_ISA`` does not change it)."""
    return getattr(torch.cpu, '_is_amx_tile_supported', lambda: False)()


def int8_gemm() -> ModuleType | None:
    """The kernels when their ``int8_linear`` (AVX512-VNNI) was built for this CPU; else None."""
    module = native()
    return module if module is not None and module.int8_gemm_available() else None


def int4_gemv() -> ModuleType | None:
    """The kernels when their ``int4_linear`` (AVX512-BF16) was built for this CPU; else None."""
    module = native()
    return module if module is not None and module.int4_gemv_available() else None


def fp32_gemm() -> ModuleType | None:
    """The kernels when their ``fp32_packed_linear`` (AVX-512, or AVX2 with FMA) was built for this CPU; else None."""
    module = native()
    return module if module is not None and module.fp32_packed_linear_available() else None


def fp32_gemm_isa() -> str | None:
    """The instruction set that fp32 weights packed now run ``fp32_packed_linear`` on: the widest it was built for
    (``'avx512'``, else ``'avx2'``), or ``LMDEPLOY_CPU_FP32_GEMM``'s (``avx2`` runs the AVX2 kernel on an AVX-512
    CPU, as its tests do; the same bits, slower); None where it was not built."""
    module = fp32_gemm()
    if module is None:
        return None
    isas = module.fp32_packed_linear_isas()
    wanted = os.environ.get('LMDEPLOY_CPU_FP32_GEMM')
    if wanted is None:
        return isas[0]
    if wanted not in isas:
        raise ValueError(f'LMDEPLOY_CPU_FP32_GEMM={wanted}: fp32_packed_linear is built here for {", ".join(isas)}')
    return wanted


def q8_gemv() -> ModuleType | None:
    """The kernels when their ``q8_linear`` (AVX512-BF16) was built for this CPU; else None."""
    module = native()
    return module if module is not None and module.q8_gemv_available() else None


def q6k_gemv() -> ModuleType | None:
    """The kernels when their ``q6k_linear`` (AVX512-BF16) was built for this CPU; else None."""
    module = native()
    return module if module is not None and module.q6k_gemv_available() else None


def q5k_gemv() -> ModuleType | None:
    """The kernels when their ``q5k_linear`` (AVX512-BF16) was built for this CPU; else None."""
    module = native()
    return module if module is not None and module.q5k_gemv_available() else None


def mxfp4_gemv() -> ModuleType | None:
    """The kernels when their ``mxfp4_linear`` and ``mxfp4_dequantize`` (AVX-512) were built for this CPU; else None."""
    module = native()
    return module if module is not None and module.mxfp4_gemv_available() else None


def gated_delta() -> ModuleType | None:
    """The kernels when their ``gated_delta_decode`` (AVX-512) was built for this CPU; else None."""
    module = native()
    return module if module is not None and module.gated_delta_available() else None


def mamba1_scan() -> ModuleType | None:
    """The kernels when their ``mamba1_scan`` (AVX-512) was built for this CPU; else None."""
    module = native()
    return module if module is not None and module.mamba1_scan_available() else None


def bind_worker_threads() -> None:
    """Pins the calling thread's OpenMP worker threads to one CPU each, as vLLM's CPU backend pins its
    threads; the caller itself stays free, so threads it starts later are not pinned. Once per calling
    thread, thread count and set of allowed CPUs; ``LMDEPLOY_CPU_BIND=0`` turns it off. Unpinned, a
    worker that the OS moves or shares a CPU with the main thread stalls every barrier: offline
    throughput measured 5-7% lower and more variable on the 2-core machine."""
    if os.environ.get('LMDEPLOY_CPU_BIND', '1') == '0' or not hasattr(os, 'sched_getaffinity'):
        return
    threads = torch.get_num_threads()
    cpus = sorted(os.sched_getaffinity(0))
    if getattr(_this_thread, 'bound', None) == (threads, cpus):
        return
    _this_thread.bound = (threads, cpus)
    module = native()
    if module is not None and threads <= len(cpus):
        module.bind_worker_threads(cpus)


def cache_key(flags: Iterable[str]) -> str:
    """A short hash of the CPU flags a build targets, for its cache name: the same flags give the same
    key, any difference (another CPU model, one feature more or less) another."""
    return hashlib.sha256('\0'.join(flags).encode()).hexdigest()[:16]


def target_flags(driver_output: str) -> list[str]:
    """The target flags in a compiler driver's ``-###`` listing of its compile command: gcc's expansion of
    ``-march=native`` (``-march=znver3 -mavx512f ... --param l2-cache-size=1024 -mtune=znver3``) or
    clang's (``-target-cpu znver3 -target-feature +avx512f ...``)."""
    for line in driver_output.splitlines():
        if 'cc1' not in line:
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        flags = []
        for index, word in enumerate(words):
            if word.startswith('-m') or word.startswith('--param='):
                flags.append(word)
            elif word in ('--param', '-target-cpu', '-target-feature', '-tune-cpu') and index + 1 < len(words):
                flags += [word, words[index + 1]]
        if flags:
            return flags
    return []


def cpu_flags() -> list[str]:
    """What ``-march=native`` stands for on this CPU, as the C++ compiler that builds the kernels (``$CXX``
    or ``c++``) expands it; without a compiler that says, the CPU's model and feature flags from
    ``/proc/cpuinfo``."""
    compiler = os.environ.get('CXX', 'c++')
    try:
        proc = subprocess.run([compiler, '-march=native', '-###', '-E', '-x', 'c++', os.devnull],
                              capture_output=True, text=True, timeout=60)
        flags = target_flags(proc.stderr)
        if flags:
            return flags
    except (OSError, subprocess.SubprocessError):
        pass
    flags = []
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                key, _, value = line.partition(':')
                if key.strip() in ('model name', 'flags', 'Features', 'CPU part') and value.strip() not in flags:
                    flags.append(value.strip())
    except OSError:
        pass
    import platform
    return flags or [platform.machine(), platform.processor()]


def build_name(flags: Iterable[str], source_dir: str = os.path.dirname(os.path.abspath(__file__))) -> str:
    """The build's name: ``lmdeploy_cpu_kernels_`` and a hash of the lmdeploy and torch versions, the sources
    (every file of ``source_dir`` but Python's), where they are (torch's ``build.ninja`` names them by absolute
    path, so two checkouts sharing one folder would rebuild it in turn) and the CPU ``flags`` (see
    :func:`cache_key`)."""
    from lmdeploy import __version__
    digest = hashlib.sha256(f'{__version__}\0{torch.__version__}\0{cache_key(flags)}\0{source_dir}'.encode())
    for name in sorted(os.listdir(source_dir)):
        if name.endswith(('.cpp', '.h')):
            with open(os.path.join(source_dir, name), 'rb') as f:
                digest.update(name.encode() + b'\0' + f.read())
    return f'lmdeploy_cpu_kernels_{digest.hexdigest()[:16]}'


class BuildProgress:
    """Says on stderr that the kernels compile, and how far: on a terminal one line that ticks every second,
    elsewhere a line every 15 s."""

    def __init__(self, build_dir: str):
        self.build_dir = build_dir
        self.start = time.monotonic()
        self.done = threading.Event()
        self.tty = sys.stderr.isatty()
        self.thread = threading.Thread(target=self._run, name='lmdeploy-kernel-build-progress', daemon=True)

    def __enter__(self) -> BuildProgress:
        print('compiling native CPU kernels (once, a few minutes)...', file=sys.stderr, flush=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        ok = exc[0] is None
        print(f'{self._line()}: {"done" if ok else "failed"}', file=sys.stderr, flush=True)

    def _line(self) -> str:
        try:
            compiled = sum(name.endswith('.o') for name in os.listdir(self.build_dir))
        except OSError:
            compiled = 0
        return f'  {time.monotonic() - self.start:.0f} s, {compiled}/{len(_SOURCES)} translation units compiled'

    def _run(self) -> None:
        while not self.done.wait(1.0 if self.tty else 15.0):
            print(f'\r{self._line()}' if self.tty else self._line(), end='' if self.tty else '\n',
                  file=sys.stderr, flush=True)
        if self.tty:
            print('\r', end='', file=sys.stderr)


def _build() -> ModuleType | None:
    if os.environ.get('LMDEPLOY_CPU_KERNELS', '1') == '0':
        return None
    from torch.utils.cpp_extension import get_default_build_root, load
    here = os.path.dirname(__file__)
    name = build_name(cpu_flags())
    build_dir = os.path.join(os.environ.get('TORCH_EXTENSIONS_DIR') or get_default_build_root(), name)
    os.makedirs(build_dir, exist_ok=True)
    logger.info('loading the native CPU kernels from %s', build_dir)
    try:
        with open(os.path.join(build_dir, 'lmdeploy.lock'), 'w') as lock:
            if _locked_elsewhere(lock):
                print(f'waiting for another process that builds the native CPU kernels in {build_dir}...',
                      file=sys.stderr, flush=True)
                fcntl.flock(lock, fcntl.LOCK_EX)
            # Holding our lock, no other lmdeploy process builds here: a torch lock file left by a build that
            # was killed (Ctrl-C) is stale, and torch would wait on it forever.
            _remove(os.path.join(build_dir, 'lock'))
            built = os.path.isfile(os.path.join(build_dir, f'{name}.so'))
            with contextlib.nullcontext() if built else BuildProgress(build_dir):
                return load(name, [os.path.join(here, source) for source in _SOURCES], extra_cflags=_FLAGS,
                            extra_ldflags=['-fopenmp'], build_directory=build_dir)
    except Exception as exc:  # no compiler, no headers, ...: fall back to torch, loudly
        logger.warning('native CPU kernels unavailable (%s: %s); using the torch versions', type(exc).__name__, exc)
        return None


def _locked_elsewhere(lock) -> bool:
    """Takes ``lock`` if it is free; True when another process holds it."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
