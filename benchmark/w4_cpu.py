"""Time of one linear layer on the CPU by step size (tokens): a 4-bit checkpoint's weight on torch's int4
kernel, on the native int4 GEMV (the same grid, fp16 scales and offsets per 32 inputs), on the same grid
dequantized on each call (the reference kernel), and the bf16 weight on the native GEMM and oneDNN. It shows
what running a checkpoint's grid on the GEMV at every step size costs (``Int4GroupFormat.cpu_kernel``).

    python benchmark/w4_cpu.py [--shapes 2048x2048,2048x11008] [--group 128] [--one-thread]

``--one-thread``: one thread, each call timed by the thread's CPU time (``time.thread_time``), so that other jobs
on a shared machine take time slices but not figures.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.cpu_bf16 import NativeBf16Kernel, OneDnnKernel
from lmdeploy.pytorch.nn.quant.int4_cpu import NativeInt4Kernel, grid_packed
from lmdeploy.pytorch.nn.quant.w4a16 import Int4Grid

STEPS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


CLOCK = time.perf_counter  # time.thread_time with --one-thread


def best_ms(fn: Callable[[], object], seconds: float = 1.0) -> float:
    """The fastest of repeated calls: on a shared machine the others measure the neighbours."""
    fn()
    best = float('inf')
    deadline = CLOCK() + seconds
    for _ in range(1000):
        start = CLOCK()
        fn()
        best = min(best, CLOCK() - start)
        if start > deadline:
            break
    return best * 1e3


def rotating(kernels: list[Callable[[torch.Tensor], torch.Tensor]]) -> Callable[[torch.Tensor], None]:
    """One call of each kernel in turn (distinct weights, more bytes than the last-level cache holds, as
    a model's layers are): the timing is divided by their number."""
    def run(x: torch.Tensor) -> None:
        for kernel in kernels:
            kernel(x)
    return run


def bench_shape(in_features: int, out_features: int, group_size: int, cache_bytes: int) -> None:
    g = torch.Generator().manual_seed(0)
    groups = in_features // group_size
    copies = {'int4': -(-cache_bytes // (in_features * out_features // 2)),
              'bf16': -(-cache_bytes // (in_features * out_features * 2))}
    grids = [Int4Grid.of_zeros(torch.randint(0, 16, (out_features, in_features), generator=g),
                               torch.randint(0, 16, (groups, out_features), generator=g),
                               (torch.rand(groups, out_features, generator=g) * 0.01).bfloat16(), group_size)
             for _ in range(copies['int4'])]
    int4 = []
    for grid in grids:
        packed, scales_and_zeros = grid_packed(grid, torch.bfloat16)
        int4.append(lambda x, p=packed, s=scales_and_zeros:
                    torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, group_size, s))
    weights = [grid.dequantize(torch.bfloat16) for grid in grids[:copies['bf16']]]
    paths = {'int4': (rotating(int4), len(int4))}
    gemv = [NativeInt4Kernel.of_grid(grid) for grid in grids]
    if all(kernel is not None for kernel in gemv):
        paths['native int4 GEMV'] = (rotating([lambda x, k=k: k(x, None) for k in gemv]), len(gemv))
    paths['dequant+F.linear'] = (lambda x: torch.nn.functional.linear(x, grids[0].dequantize(torch.bfloat16)), 1)
    onednn = [OneDnnKernel(torch.ops.mkldnn._reorder_linear_weight(w)) for w in weights]
    paths['oneDNN bf16'] = (rotating([lambda x, k=k: k(x, None) for k in onednn]), len(onednn))
    gemm = cpu.bf16_gemm()
    if gemm is not None:
        native = [NativeBf16Kernel(gemm.pack_bf16_weight(w), False, w.shape[0]) for w in weights]
        paths['native bf16'] = (rotating([lambda x, k=k: k(x, None) for k in native]), len(native))
    del grids[1:], weights
    print(f'\n{in_features} -> {out_features}, group {group_size} (ms per call, best of repeats)')
    print('| tokens | ' + ' | '.join(paths) + ' |')
    print('| --- ' * (len(paths) + 1) + '|')
    for rows in STEPS:
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        times = [best_ms(lambda: fn(x)) / n for fn, n in paths.values()]
        print(f'| {rows} | ' + ' | '.join(f'{t:.3f}' for t in times) + ' |', flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--shapes', default='2048x2048,2048x11008,5632x2048', help='IN x OUT, comma-separated')
    parser.add_argument('--group', type=int, default=128)
    parser.add_argument('--cache-mb', type=int, default=96, help='bytes each path rotates over (> the L3)')
    parser.add_argument('--one-thread', action='store_true', help='one thread, timed by its CPU time')
    args = parser.parse_args()
    if args.one_thread:
        global CLOCK
        torch.set_num_threads(1)
        CLOCK = time.thread_time
    for shape in args.shapes.split(','):
        in_features, out_features = map(int, shape.split('x'))
        bench_shape(in_features, out_features, args.group, args.cache_mb << 20)


if __name__ == '__main__':
    main()
