"""Every native CPU source compiles for a plain AVX2 CPU (``-march=x86-64-v3``): each AVX-512 kernel builds its
stub there (``int4_gemv_available()``, ``q8_gemv_available()``, ``q5k_gemv_available()``, ``int8_gemm_available()``,
``gated_delta_available()``, ... false) and the torch versions run, as the fallback tests of each kernel check.
One file failing would fail the whole build on such a CPU, so every file is checked."""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils.cpp_extension import include_paths

from lmdeploy.pytorch.kernels import cpu

FLAGS = ['-std=c++17', '-march=x86-64-v3', '-fopenmp']


@pytest.mark.slow
def test_every_source_compiles_without_avx512(tmp_path):
    # torch's headers take most of each file's parse: they are precompiled once, next to a copy of the sources
    shutil.copytree(os.path.dirname(cpu.__file__), tmp_path, dirs_exist_ok=True)
    compiler = os.environ.get('CXX', 'c++')
    includes = [f'-I{path}' for path in include_paths()] + [f'-I{sysconfig.get_paths()["include"]}']
    header = str(tmp_path / 'torch_headers.h')
    pch = subprocess.run([compiler, *FLAGS, *includes, '-x', 'c++-header', header, '-o', header + '.gch'],
                         capture_output=True, text=True)
    assert pch.returncode == 0, pch.stderr[-2000:]

    def check(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([compiler, *FLAGS, '-O0', '-c', '-o', os.devnull, '-include', header, *includes,
                               str(tmp_path / name)], capture_output=True, text=True)

    with ThreadPoolExecutor(2) as pool:
        failed = {name: proc.stderr[-2000:] for name, proc in zip(cpu._SOURCES, pool.map(check, cpu._SOURCES))
                  if proc.returncode}
    assert not failed, failed
