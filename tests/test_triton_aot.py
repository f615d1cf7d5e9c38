"""Every Triton kernel compiles for an H100/H200 (sm_90) on the CPU, through its wrapper, within the per-block
shared-memory limit: ``benchmark/triton_aot.py --quick`` (the full sweep is the script without ``--quick``).

Not marked ``triton``: that marker runs the kernels (interpreter or GPU); this compiles them with Triton's own
ptxas and runs nothing. Each test runs in a subprocess without ``TRITON_INTERPRET``, which the conftest sets and
which makes ``@triton.jit`` build interpreter functions at import."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_LIMIT = 232448


def _has_ptxas() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return os.access(get_ptxas(90).path, os.X_OK)
    except (ImportError, RuntimeError):
        return False


pytestmark = pytest.mark.skipif(not _has_ptxas(), reason="no triton with NVIDIA's ptxas")


def _start(*args: str, cwd: str = ROOT) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != 'TRITON_INTERPRET'}
    env['PYTHONPATH'] = os.pathsep.join([ROOT, os.path.join(ROOT, 'benchmark'), env.get('PYTHONPATH', '')])
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict[str, subprocess.Popen]:
    """The sweep and the harness check, started side by side (their imports are a good part of each)."""
    folder = tmp_path_factory.mktemp('harness')
    (folder / 'harness_check.py').write_text(textwrap.dedent(HARNESS_CHECK))
    processes = {'sweep': _start('benchmark/triton_aot.py', '--quick', '--jobs', str(min(2, os.cpu_count() or 1))),
                 'harness': _start(str(folder / 'harness_check.py'), cwd=str(folder))}
    yield processes
    for process in processes.values():
        process.kill()
        process.wait()


def test_every_kernel_compiles_for_sm90_within_the_shared_memory_limit(runs):
    result = _finished(runs['sweep'])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = re.search(r'(\d+) compiles of (\d+) kernels .*: (\d+) ok, 0 failed', result.stdout)
    assert summary and summary.group(1) == summary.group(3), result.stdout[-3000:]
    max_shared = int(re.search(r'max shared (\d+) B', result.stdout).group(1))
    assert 0 < max_shared <= SHARED_LIMIT


HARNESS_CHECK = '''
import torch, triton, triton.language as tl
from triton_aot import compile_case, compile_only
from triton_aot_cases import Case


SCALE = 0.5


@triton.jit
def copy_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def scale_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * SCALE)


@triton.jit
def matmul_kernel(a_ptr, c_ptr, BLOCK: tl.constexpr, K: tl.constexpr):
    r = tl.arange(0, BLOCK)
    k = tl.arange(0, K)
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for i in range(0, 8):
        a = tl.load(a_ptr + i * BLOCK * K + r[:, None] * K + k[None, :])
        b = tl.load(a_ptr + i * BLOCK * K + k[:, None] * BLOCK + r[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], acc)


def launch(kernel, dtype, **constexprs):
    x = torch.empty(1 << 20, dtype=dtype, device='meta')
    kernel[(1,)](x, x, **constexprs, num_stages=4)


cases = [Case('copy', lambda dtype: launch(copy_kernel, dtype, BLOCK=128)),
         Case('tiles over the limit', lambda dtype: launch(matmul_kernel, dtype, BLOCK=256, K=128)),
         Case('global', lambda dtype: launch(scale_kernel, dtype, BLOCK=128))]
with compile_only() as launches:
    for case in cases:
        for row in compile_case(case, torch.bfloat16, launches):
            print(row.case, row.ok, row.shared, row.registers, (row.error or '').splitlines()[:1])
'''


def test_the_harness_reports_shared_memory_over_the_limit_and_compile_errors(runs):
    """A plain kernel compiles (registers reported), 256 x 256 tiles in 4 stages exceed the limit, and a kernel
    reading a global that is not ``tl.constexpr`` fails to compile (the interpreter runs it)."""
    result = _finished(runs['harness'])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {case: row.split(' ', 3) for case, row in (line.split(' bfloat16 ') for line in result.stdout.splitlines())}
    ok, shared, registers, _ = rows['copy']
    assert ok == 'True' and int(registers) > 0
    ok, shared, _, _ = rows['tiles over the limit']
    assert ok == 'False' and int(shared) > SHARED_LIMIT
    ok, _, _, error = rows['global']
    assert ok == 'False' and 'CompilationError' in error
