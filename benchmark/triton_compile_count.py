"""Counts the Triton kernel specializations a pytest run compiles on an H100/H200 (sm_90), no GPU needed: what a
fresh GPU machine's empty Triton cache costs the test parts of ``benchmark/gpu_check.sh``.

    python benchmark/triton_compile_count.py -- -m triton tests/test_kernels_moe.py
    LMDEPLOY_TEST_KERNELS=triton python benchmark/triton_compile_count.py -- tests/test_engine_correctness.py

The tests run in Triton's interpreter on the CPU; each launch is also bound as Triton's JIT binds it for sm_90
(dtypes, constexprs, integer and alignment specializations, warps, stages), which gives the key of the JIT's
in-memory cache: one compile per distinct key and process. Prints the specializations per test file and per
kernel, in the order the run first met them. The seconds a compile takes: ``benchmark/triton_aot.py`` (it
compiles for sm_90 on the CPU; a compile cannot run in this process, whose helper functions are interpreted).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

os.environ['TRITON_INTERPRET'] = '1'  # before triton is imported: the tests' kernels are interpreted

import pytest  # noqa: E402
import triton  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from compile_only_driver import CompileOnlyDriver  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class SpecializationCounter:
    """A pytest plugin: binds every interpreted launch for sm_90 as well and counts the distinct keys."""

    def __init__(self):
        self.keys: set[tuple[str, str]] = set()
        self.by_file: Counter[str] = Counter()
        self.by_kernel: Counter[str] = Counter()
        self.test = ''
        self._jit: dict[object, JITFunction] = {}

    def _cache_hook(self, *, key, fn, **_) -> bool:
        """Triton's ``jit_cache_hook``, called for a key missing from the JIT's cache; True: no compile."""
        name = fn.jit_function.fn.__name__
        if (name, key) not in self.keys:
            self.keys.add((name, key))
            self.by_file[self.test.partition('::')[0]] += 1
            self.by_kernel[name] += 1
        return True

    def _bind(self, interpreted: InterpretedFunction, args: tuple, grid, kwargs: dict) -> None:
        jit = self._jit.get(interpreted.fn)
        if jit is None:
            jit = self._jit[interpreted.fn] = JITFunction(interpreted.fn, **interpreted.kwargs)
        active = driver._active  # None: not chosen yet
        driver.set_active(CompileOnlyDriver(90))
        try:
            jit.run(*args, grid=grid, warmup=True, **kwargs)
        finally:
            driver.set_active(active)

    def pytest_configure(self, config) -> None:
        interpreted_run = InterpretedFunction.run

        def run(interpreted, *args, grid, warmup, **kwargs):
            self._bind(interpreted, args, grid, kwargs)
            return interpreted_run(interpreted, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        triton.knobs.runtime.jit_cache_hook = self._cache_hook

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.test = nodeid

    def report(self) -> None:
        print(f'\n{len(self.keys)} distinct specializations over {len(self.by_kernel)} kernels')
        for title, counts in (('test file', self.by_file), ('kernel', self.by_kernel)):
            print(f'{title:<48} {"specializations":>15}')
            for name, count in counts.items():
                print(f'{name:<48} {count:>15}')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('pytest_args', nargs='*', help='after --: the arguments of pytest')
    args = parser.parse_args()
    counter = SpecializationCounter()
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))  # this tree's lmdeploy
    status = pytest.main(['-p', 'no:cacheprovider', *args.pytest_args], plugins=[counter])
    counter.report()
    return int(status)


if __name__ == '__main__':
    sys.exit(main())
