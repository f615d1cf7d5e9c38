"""Compiles every Triton kernel of ``lmdeploy/pytorch/kernels/cuda`` for an H100/H200 (sm_90) on the CPU, no GPU.

    python benchmark/triton_aot.py            # the full sweep: production shapes, bf16 and fp16
    python benchmark/triton_aot.py --quick    # one config per kernel (tests/test_triton_aot.py)
    python benchmark/triton_aot.py -k gemma   # only the cases whose name holds 'gemma'

Each case calls a kernel's real Python wrapper on meta tensors of a model's shapes, so the launch options
(block sizes, warps, stages, constexpr flags, integer specializations) are exactly those the wrapper picks. A
stand-in driver reports an sm_90 device and every launch compiles (Triton's front end, LLVM, ptxas) instead
of running. Prints one row per kernel x case: status, warps, stages, shared memory per block (limit 232,448
bytes, the H100/H200 opt-in maximum), registers per thread, spill stores and ptxas' performance notes. Exits
non-zero if a compile fails, a block needs more shared memory than the limit, or a kernel of the package is
never compiled. Numerics and speed need a GPU (``benchmark/gpu_check.sh``).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import pkgutil
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial

os.environ.pop('TRITON_INTERPRET', None)  # before triton is imported: compile, not interpret

import torch
import triton
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from compile_only_driver import CompileOnlyDriver
from triton_aot_cases import CASES, QUICK_CASES, Case

SHARED_LIMIT = 232448  # bytes per block, opt-in maximum of sm_90 (H100, H200)
_PERF_NOTE = re.compile(r'Potential Performance Loss: (.*)')
_STATS: dict[int, dict] = {}  # by id of a compiled kernel: Triton's in-memory cache returns it without ptxas' log


@dataclass
class Compiled:
    """One kernel's compile in one case; ``error`` is None when it compiled."""
    case: str
    kernel: str
    error: str | None = None
    num_warps: int = 0
    num_stages: int = 0
    shared: int = 0
    registers: int = 0
    spill_bytes: int = 0
    notes: str = ''

    @property
    def ok(self) -> bool:
        return self.error is None and self.shared <= SHARED_LIMIT


def _stats(kernel, ptxas_log: str) -> dict:
    used = re.search(r'Used (\d+) registers', ptxas_log)
    spills = re.search(r'(\d+) bytes spill stores', ptxas_log)
    notes = sorted({m.group(1).split(' in the function')[0] for m in _PERF_NOTE.finditer(ptxas_log)})
    return dict(num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages,
                shared=kernel.metadata.shared, registers=int(used.group(1)) if used else -1,
                spill_bytes=int(spills.group(1)) if spills else -1, notes='; '.join(notes))


@contextlib.contextmanager
def compile_only(capability: int = 90) -> Iterator[list[tuple[str, dict | Exception]]]:
    """Within it, a kernel launch compiles for ``capability`` (into a fresh cache, so ptxas runs and reports)
    and returns without running; yields the list of ``(kernel name, stats or the exception)`` launches append to."""
    launches: list[tuple[str, dict | Exception]] = []
    original_run, original_driver = JITFunction.run, driver._active

    def run(self, *args, grid, warmup, **kwargs):
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):  # ptxas' log; on a ptxas error also the whole PTX
                kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as error:
            launches.append((self.fn.__name__, error))
            raise
        stats = _STATS.setdefault(id(kernel), _stats(kernel, log.getvalue()))
        launches.append((self.fn.__name__, stats))
        return kernel

    with tempfile.TemporaryDirectory(prefix='triton_aot_') as cache_dir, \
            triton.knobs.cache.scope(), triton.knobs.nvidia.scope(), warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='TRITON_DEFAULT_FP_FUSION')
        triton.knobs.cache.dir = cache_dir
        triton.knobs.nvidia.dump_ptxas_log = True
        driver.set_active(CompileOnlyDriver(capability))
        JITFunction.run = run
        try:
            yield launches
        finally:
            JITFunction.run = original_run
            driver.set_active(original_driver)


def _describe(error: Exception) -> str:
    """The error's type and cause: for a front-end error the kernel source line Triton points at, else the
    innermost exception's first lines (ptxas' message for a ptxas error)."""
    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    located = [e for e in chain if type(e).__name__ == 'CompilationError']
    shown = located[-1] if located else chain[-1]
    lines = [line for line in str(shown).splitlines() if line.strip()]
    return '\n'.join([type(shown).__name__] + (lines[-3:] if located else lines[:6]))


def compile_case(case: Case, dtype: torch.dtype, launches: list) -> list[Compiled]:
    """Runs ``case`` within :func:`compile_only`; one :class:`Compiled` per distinct kernel it compiled (a failing
    launch ends the case)."""
    label = f'{case.name} {str(dtype).removeprefix("torch.")}'
    start = len(launches)
    try:
        case.run(dtype)
    except Exception as error:  # noqa: BLE001 - reported in the table; a wrapper's own error too
        if len(launches) == start or not isinstance(launches[-1][1], Exception):
            launches.append(('(wrapper)', error))
    rows, seen = [], []  # a kernel compiled once is launched again with the same stats object
    for kernel, result in launches[start:]:
        if isinstance(result, Exception):
            rows.append(Compiled(label, kernel, error=_describe(result)))
        elif not any(result is other for other in seen):
            seen.append(result)
            rows.append(Compiled(label, kernel, **result))
    return rows


def compile_task(task: tuple[Case, torch.dtype], capability: int = 90) -> list[Compiled]:
    """:func:`compile_case` in a :func:`compile_only` of its own (a process pool's unit of work)."""
    with compile_only(capability) as launches:
        return compile_case(*task, launches)


def entry_kernels() -> set[str]:
    """The names of the package's kernels (``@triton.jit`` functions named ``*_kernel``)."""
    import lmdeploy.pytorch.kernels.cuda as package
    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = __import__(f'{package.__name__}.{info.name}', fromlist=['_'])
        names |= {obj.fn.__name__ for obj in vars(module).values()
                  if isinstance(obj, JITFunction) and obj.fn.__name__.endswith('_kernel')}
    return names


def print_rows(rows: list[Compiled], header: bool = False) -> None:
    if header:
        print(f'{"case":<48} {"kernel":<26} {"status":<6} {"warps":>5} {"stages":>6} {"shared B":>9} {"regs":>4} '
              f'{"spill B":>7}  notes')
    for row in rows:
        status = 'ERROR' if row.error else ('SHARED' if row.shared > SHARED_LIMIT else 'ok')
        print(f'{row.case:<48} {row.kernel:<26} {status:<6} {row.num_warps:>5} {row.num_stages:>6} '
              f'{row.shared:>9} {row.registers:>4} {row.spill_bytes:>7}  {row.notes}', flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--quick', action='store_true', help='one config per kernel, bf16 only')
    parser.add_argument('-k', default='', help='only the cases whose name contains this')
    parser.add_argument('--capability', type=int, default=90, help='compute capability to compile for')
    parser.add_argument('--jobs', type=int, default=1, help='compiling processes')
    args = parser.parse_args()
    cases = [case for case in (QUICK_CASES if args.quick else CASES) if args.k in case.name]
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16)
    tasks = [(case, dtype) for case in cases for dtype in dtypes]
    start = time.perf_counter()
    rows: list[Compiled] = []
    print_rows([], header=True)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context('fork')) if args.jobs > 1 \
            else contextlib.nullcontext() as pool:
        for case_rows in (pool.map if pool else map)(partial(compile_task, capability=args.capability), tasks):
            print_rows(case_rows)
            rows += case_rows
    compiled = [row for row in rows if row.error is None]
    failed = [row for row in rows if not row.ok]
    missing = entry_kernels() - {row.kernel for row in compiled} if not args.k else set()
    print(f'\n{len(rows)} compiles of {len({row.kernel for row in rows})} kernels in {len(tasks)} '
          f'case x dtype runs, sm_{args.capability}, {time.perf_counter() - start:.0f} s: {len(rows) - len(failed)} '
          f'ok, {len(failed)} failed')
    if compiled:
        print(f'max shared {max(row.shared for row in compiled)} B (limit {SHARED_LIMIT}), max registers '
              f'{max(row.registers for row in compiled)}, spilling: {sum(row.spill_bytes > 0 for row in compiled)}, '
              f'ptxas performance notes: {sum(bool(row.notes) for row in compiled)}')
    for row in failed:
        print(f'\nFAILED {row.case} / {row.kernel}:\n{row.error or f"shared {row.shared} B > {SHARED_LIMIT}"}')
    if missing:
        print(f'\nFAILED: never compiled: {", ".join(sorted(missing))}')
    return 1 if failed or missing else 0


if __name__ == '__main__':
    sys.exit(main())
