"""Every native CPU source compiles for a plain AVX2 CPU (``-march=x86-64-v3``): each AVX-512 kernel builds its
stub there (``int4_gemv_available()``, ``q8_gemv_available()``, ``q5k_gemv_available()``, ``int8_gemm_available()``,
``gated_delta_available()``, ... false) and the torch versions run, as the fallback tests of each kernel check.
One file failing would fail the whole build on such a CPU, so every file is checked."""
from __future__ import annotations

import os
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils.cpp_extension import include_paths

from lmdeploy.pytorch.kernels import cpu

FLAGS = ['-std=c++17', '-march=x86-64-v3', '-fopenmp', '-O0']


@pytest.mark.slow
def test_every_source_compiles_without_avx512(tmp_path):
    # Object code, not a syntax check: an intrinsic of a missing instruction set fails only where it is inlined.
    # The kernel sources compile as one translation unit (torch's headers, most of each file's time, parsed once;
    # the native build compiles each file alone), pybind's bindings as a second one beside it.
    here = os.path.dirname(cpu.__file__)
    kernels = tmp_path / 'kernels.cpp'
    kernels.write_text(''.join(f'#include "{os.path.join(here, name)}"\n' for name in cpu._SOURCES
                               if name != 'bindings.cpp'))
    compiler = os.environ.get('CXX', 'c++')
    includes = [f'-I{path}' for path in include_paths()] + [f'-I{sysconfig.get_paths()["include"]}']

    def check(source: str) -> subprocess.CompletedProcess:
        return subprocess.run([compiler, *FLAGS, '-c', '-o', os.devnull, *includes, source],
                              capture_output=True, text=True)

    sources = [str(kernels), os.path.join(here, 'bindings.cpp')]
    with ThreadPoolExecutor(2) as pool:
        failed = {source: proc.stderr[-2000:] for source, proc in zip(sources, pool.map(check, sources))
                  if proc.returncode}
    assert not failed, failed
