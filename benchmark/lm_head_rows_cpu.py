"""The 8-bit LM head's GEMV (``q8_linear``, ``kernels/cpu/linear_q8.cpp``) by step size, against the bf16 table's
packed GEMM in the same run: the default model's table (49,152 x 576) and Gemma 3 270M's tied one (262,144 x 640),
random Q8_0 codes and scales, bf16 activations. Decode steps of every size run the 8-bit copy (see
docs/batch_invariance.md); the bf16 table is what they ran before it (``decode_int4`` off, or a step of many rows). One
thread, timed by its CPU time (``time.thread_time``) so that other jobs on a shared machine take time slices but
not figures; per row count the best of ``--repeats`` calls, the two kernels alternating over ``--rounds``.
Each kernel's output is a new tensor (fp32 for the copy: 64 MiB at 64 rows of Gemma's table; bf16 for the table);
each line gives what touching a new tensor of that size first costs in this process (``first touch``: a fresh
tensor filled, less the same fill on a kept one), which a kernel's time includes where the allocator hands it fresh
pages: on 4 KiB pages, and for the copy's fp32 output also on the 2 MiB pages its kernel asks for (``empty_output``,
``kernels/cpu/common.h``). Run it in two trees (fresh processes, alternating) to compare a kernel change::

    PYTHONPATH=. python benchmark/lm_head_rows_cpu.py [--rows 1,2,8,24,64] [--tables default,gemma]
"""
from __future__ import annotations

import argparse
import ctypes
import time

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.cpu_bf16 import packed_cpu_kernel
from lmdeploy.pytorch.nn.quant.q8_cpu import Q8Gemv, q8_grid

TABLES = {'default': (49152, 576), 'gemma': (262144, 640)}


def q8_table(rows: int, inputs: int, generator: torch.Generator) -> torch.Tensor:
    """A bf16 table that a Q8_0 grid holds exactly (as a Q8_0 file's table loaded in bf16)."""
    codes, scale = q8_grid(torch.randn(rows, inputs, generator=generator) * 0.05)
    return (codes.float().view(rows, -1, 32) * scale.float()[..., None]).view(rows, inputs).bfloat16()


def best_ms(kernel, x: torch.Tensor, repeats: int) -> float:
    best = float('inf')
    for _ in range(repeats):
        start = time.thread_time()
        kernel(x)
        best = min(best, time.thread_time() - start)
    return 1e3 * best


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its whole 2 MiB pages advised huge (``MADV_HUGEPAGE``), as ``empty_output`` does."""
    huge, libc = 2 << 20, ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    first, end = -(-t.data_ptr() // huge) * huge, (t.data_ptr() + t.nbytes) // huge * huge
    if end > first:
        libc.madvise(first, end - first, 14)
    return t


def first_touch_ms(rows: int, columns: int, dtype: torch.dtype, repeats: int, huge: bool = False) -> float:
    """What filling a new ``[rows, columns]`` tensor (``huge``: on 2 MiB pages) costs more than filling a kept one
    (its pages' first touch)."""
    kept = torch.empty(rows, columns, dtype=dtype)
    advise = on_huge_pages if huge else (lambda t: t)
    return (best_ms(lambda _: advise(torch.empty(rows, columns, dtype=dtype)).fill_(1), None, repeats) -
            best_ms(lambda _: kept.fill_(1), None, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rows', default='1,2,8,24,64')
    parser.add_argument('--tables', default='default,gemma')
    parser.add_argument('--repeats', type=int, default=10)
    parser.add_argument('--rounds', type=int, default=3)
    args = parser.parse_args()
    if cpu.q8_gemv() is None:
        raise SystemExit('the 8-bit GEMV needs AVX512-BF16')
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for name in args.tables.split(','):
        table = q8_table(*TABLES[name], g)
        q8, bf16 = Q8Gemv.of(table), packed_cpu_kernel(table)
        kernels = {'q8': q8, 'bf16': lambda x: bf16(x, None)}
        for rows in map(int, args.rows.split(',')):
            x = torch.randn(rows, table.shape[1], generator=g).bfloat16()
            times = {kind: [] for kind in kernels}
            for _ in range(args.rounds):
                for kind, kernel in kernels.items():
                    times[kind].append(best_ms(kernel, x, args.repeats))
            q8_ms, bf16_ms = min(times['q8']), min(times['bf16'])
            touch = [first_touch_ms(rows, table.shape[0], dtype, args.repeats, huge)
                     for dtype, huge in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False))]
            print(f'{name} {rows:3d} rows: q8 {q8_ms:8.2f} ms  bf16 table {bf16_ms:8.2f} ms  q8 / bf16 '
                  f'{q8_ms / bf16_ms:.2f}; first touch of the outputs: fp32 {touch[0]:.2f} ms (2 MiB pages '
                  f'{touch[1]:.2f}), bf16 {touch[2]:.2f} ms', flush=True)


if __name__ == '__main__':
    main()
