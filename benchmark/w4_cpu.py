"""Time of one linear layer on the CPU by step size (tokens): a 4-bit checkpoint's weight on torch's int4
kernel, on the same grid dequantized on each call (the reference kernel), and the bf16 weight on the
native GEMM and oneDNN. It picks the step sizes each 4-bit path serves (``nn/quant/int4_cpu.py``).

    python benchmark/w4_cpu.py [--shapes 2048x2048,2048x11008] [--group 128]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.cpu_bf16 import NativeBf16Kernel, OneDnnKernel
from lmdeploy.pytorch.nn.quant.int4_cpu import grid_packed
from lmdeploy.pytorch.nn.quant.w4a16 import Int4Grid

STEPS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def best_ms(fn: Callable[[], object], seconds: float = 0.5) -> float:
    """The fastest of repeated calls: on a shared machine the others measure the neighbours."""
    fn()
    best = float('inf')
    deadline = time.perf_counter() + seconds
    for _ in range(1000):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if start > deadline:
            break
    return best * 1e3


def bench_shape(in_features: int, out_features: int, group_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    groups = in_features // group_size
    grid = Int4Grid.of_zeros(torch.randint(0, 16, (out_features, in_features), generator=g),
                             torch.randint(0, 16, (groups, out_features), generator=g),
                             (torch.rand(groups, out_features, generator=g) * 0.01).bfloat16(), group_size)
    packed, scales_and_zeros = grid_packed(grid, torch.bfloat16)
    weight = grid.dequantize(torch.bfloat16)
    gemm = cpu.bf16_gemm()
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        'int4': lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros),
        'dequant+F.linear': lambda x: torch.nn.functional.linear(x, grid.dequantize(torch.bfloat16)),
    }
    onednn = OneDnnKernel(torch.ops.mkldnn._reorder_linear_weight(weight))
    paths['oneDNN bf16'] = lambda x: onednn(x, None)
    if gemm is not None:
        native = NativeBf16Kernel(gemm.pack_bf16_weight(weight), gate_up=False)
        paths['native bf16'] = lambda x: native(x, None)
    print(f'\n{in_features} -> {out_features}, group {group_size} (ms per call, best of repeats)')
    print('| tokens | ' + ' | '.join(paths) + ' |')
    print('| --- ' * (len(paths) + 1) + '|')
    for rows in STEPS:
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        times = [best_ms(lambda: fn(x)) for fn in paths.values()]
        print(f'| {rows} | ' + ' | '.join(f'{t:.3f}' for t in times) + ' |', flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--shapes', default='2048x2048,2048x11008,5632x2048', help='IN x OUT, comma-separated')
    parser.add_argument('--group', type=int, default=128)
    args = parser.parse_args()
    for shape in args.shapes.split(','):
        in_features, out_features = map(int, shape.split('x'))
        bench_shape(in_features, out_features, args.group)


if __name__ == '__main__':
    main()
