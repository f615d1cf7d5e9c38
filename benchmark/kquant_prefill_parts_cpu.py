"""Where a GGUF K-quant layer's large step spends its time on this CPU: the weight dequantized to bf16 (into a fresh
tensor, as before), the bf16 GEMM (``F.linear`` on a weight already dequantized), and the two together: a fresh
copy then ``F.linear`` (before) and ``kquant_dequantized_linear`` (the thread's reused scratch, now). A one-row
step is no measure of the dequantization alone: its GEMV reads the whole weight too. Layers of TinyLlama's widths as
``benchmark/kquant_rows_cpu.py`` makes them (q/k/v, o, gate-and-up, down; random blocks), ``--layers`` of each so
that a pass reads more than the L3. One thread, timed by its CPU time (``time.thread_time``, which counts the
kernel's page-fault work too); best of repeats, the variants alternating.

Whether glibc hands a fresh copy the pages the previous call freed or new ones (mapped per call, their first touch
page faults and zeroing) depends on what the process allocated before: in the engine one process of the same file
took 90 k page faults a prefill step, another none. ``MALLOC_MMAP_THRESHOLD_=65536`` gives every fresh copy fresh
pages::

    PYTHONPATH=. python benchmark/kquant_prefill_parts_cpu.py --rows 128,256,512
    MALLOC_MMAP_THRESHOLD_=65536 PYTHONPATH=. python benchmark/kquant_prefill_parts_cpu.py --rows 128,256,512

``--tile-rows R`` also times dequantizing and multiplying R weight rows at a time (each tile's copy small enough to
stay in cache; layers without gate and up only) and says whether its output equals the whole-weight GEMM's.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from kquant_rows_cpu import SHAPES, kernel_of, random_blocks
from lmdeploy.pytorch.kernels import cpu


def codes_of(kernel) -> torch.Tensor:
    return kernel.codes if hasattr(kernel, 'codes') else kernel.packed


def fresh_weight(kind: str, kernel, gate_up: bool) -> torch.Tensor:
    """The kernel's weight dequantized into a new tensor."""
    native = cpu.native()
    if kind == 'q4k':
        return native.q4k_dequantize(kernel.packed, kernel.scales, gate_up)
    return getattr(native, f'{kind}_dequantize')(codes_of(kernel), kernel.scales)


def tiled_linear(kind: str, kernel, x: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """x @ W.T with W dequantized and multiplied ``tile_rows`` rows at a time."""
    codes, tiles = codes_of(kernel), tile_rows // 16
    outs = []
    for first in range(0, codes.shape[0], tiles):
        part = (codes[first:first + tiles], kernel.scales[first:first + tiles])
        weight = cpu.native().q4k_dequantize(*part) if kind == 'q4k' else getattr(cpu.native(), f'{kind}_dequantize')(
            *part)
        outs.append(F.linear(x, weight))
    return torch.cat(outs, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--kind', default='q4k', choices=['q4k', 'q5k', 'q6k'])
    parser.add_argument('--rows', default='128,256,512', help='step sizes, comma-separated')
    parser.add_argument('--layers', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=4)
    parser.add_argument('--tile-rows', type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(args.layers):
        for rows, inputs, gate_up in SHAPES:
            gate_up = gate_up and args.kind == 'q4k'
            kernel = kernel_of(args.kind, random_blocks(rng, args.kind, rows, inputs), gate_up)
            layers.append((kernel, gate_up, inputs, fresh_weight(args.kind, kernel, gate_up)))
    native = cpu.native()
    for rows in map(int, args.rows.split(',')):
        xs = {inputs: torch.randn(rows, inputs).bfloat16() for inputs in {shape[1] for shape in SHAPES}}

        def dequantize_fresh() -> None:
            for kernel, gate_up, _, _ in layers:
                fresh_weight(args.kind, kernel, gate_up)

        def gemm() -> None:
            for _, _, inputs, weight in layers:
                F.linear(xs[inputs], weight)

        def before() -> None:
            for kernel, gate_up, inputs, _ in layers:
                F.linear(xs[inputs], fresh_weight(args.kind, kernel, gate_up))

        def after() -> None:
            for kernel, gate_up, inputs, _ in layers:
                native.kquant_dequantized_linear(xs[inputs], args.kind, codes_of(kernel), kernel.scales, None, gate_up)

        def tiled() -> None:
            for kernel, gate_up, inputs, _ in layers:
                if not gate_up:
                    tiled_linear(args.kind, kernel, xs[inputs], args.tile_rows)

        def plain_after() -> None:  # the layers tiled() runs, whole
            for kernel, gate_up, inputs, _ in layers:
                if not gate_up:
                    native.kquant_dequantized_linear(xs[inputs], args.kind, codes_of(kernel), kernel.scales)

        variants: dict[str, Callable[[], None]] = {'dequantize (fresh)': dequantize_fresh, 'GEMM': gemm,
                                                  'before: fresh + GEMM': before, 'after: scratch + GEMM': after}
        if args.tile_rows:
            variants.update({f'tiles of {args.tile_rows} (no gate/up)': tiled,
                             'scratch + GEMM (no gate/up)': plain_after})
        best = dict.fromkeys(variants, float('inf'))
        for _ in range(args.repeats):
            for name, run in variants.items():
                start = time.thread_time()
                run()
                best[name] = min(best[name], time.thread_time() - start)
        line = ', '.join(f'{name} {seconds * 1e3:.1f} ms' for name, seconds in best.items())
        print(f'{args.kind}, {rows} rows, {args.layers} layer sets: {line}', flush=True)
        if args.tile_rows:
            kernel, _, inputs, _ = next(layer for layer in layers if not layer[1])
            whole = native.kquant_dequantized_linear(xs[inputs], args.kind, codes_of(kernel), kernel.scales)
            same = torch.equal(tiled_linear(args.kind, kernel, xs[inputs], args.tile_rows), whole)
            print(f'  tiled output equals the whole GEMM\'s: {same}', flush=True)


if __name__ == '__main__':
    main()
