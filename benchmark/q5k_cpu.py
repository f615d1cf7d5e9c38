"""GGUF Q5_K layers on the CPU: the Q5_K GEMV (the file's weights, 0.69 bytes a weight) against bf16 ``F.linear`` on
a dequantized copy (2 bytes a weight, which the engine does not keep), and for prefill steps the engine's path above
``gemv_max_rows('q5k')``: the layer dequantized for the call, then ``F.linear``.

The weights are random Q5_K blocks of TinyLlama's widths (q/k/v 2560 x 2048, o 2048 x 2048, gate-and-up 11264 x 2048,
down 2048 x 5632), ``--layers`` of them so that a pass reads far more than the L3, as a decode step does. One thread,
timed by its CPU time (``time.thread_time``) so that other jobs on a shared machine take time slices but not figures;
best of repeats, the kernels alternating::

    PYTHONPATH=. python benchmark/q5k_cpu.py --rows 1,4,8,16 --prefill-rows 8,16,64,512
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.q5k_cpu import Q5KGemv, unpack_q5k

SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]


def random_blocks(rng: np.random.Generator, rows: int, inputs: int) -> torch.Tensor:
    """Random Q5_K blocks ``[rows, inputs / 256, 176]`` with small fp16 ``d`` and ``dmin``."""
    blocks = rng.integers(0, 256, (rows, inputs // 256, 176), dtype=np.uint8)
    blocks[..., 0:4] = rng.uniform(1e-4, 1e-3, (rows, inputs // 256, 2)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks)


def best_times(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Each run's best thread CPU time in ms over ``repeats`` rounds, the runs alternating."""
    best = dict.fromkeys(runs, float('inf'))
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.thread_time()
            run()
            best[name] = min(best[name], time.thread_time() - start)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--rows', default='1,4,8,16', help='step sizes (rows of x) for the GEMV, comma-separated')
    parser.add_argument('--prefill-rows', default='8,16,64,512', help='step sizes for the dequantizing path')
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--repeats', type=int, default=10)
    args = parser.parse_args()
    if cpu.q5k_gemv() is None:
        raise SystemExit('the native Q5_K GEMV needs AVX512-BF16')
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    kernels = [Q5KGemv.of(random_blocks(rng, rows, inputs)) for _ in range(args.layers) for rows, inputs in SHAPES]
    copies = [unpack_q5k(kernel.codes, kernel.scales).bfloat16() for kernel in kernels]
    for label, rows_list in (('GEMV', args.rows), ('prefill', args.prefill_rows)):
        for rows in (int(r) for r in rows_list.split(',')):
            xs = {inputs: torch.randn(rows, inputs).bfloat16() for inputs in (2048, 5632)}
            if label == 'GEMV':
                step = lambda: [cpu.native().q5k_linear(xs[k.codes.shape[1] * 32], k.codes, k.scales) for k in kernels]
            else:  # the engine's path above gemv_max_rows('q5k'): the layer dequantized for the call
                step = lambda: [F.linear(xs[k.codes.shape[1] * 32], cpu.native().q5k_dequantize(k.codes, k.scales))
                                for k in kernels]
            best = best_times({'q5k': step,
                               'bf16': lambda: [F.linear(xs[w.shape[1]], w) for w in copies]}, args.repeats)
            name = 'Q5_K GEMV' if label == 'GEMV' else 'Q5_K dequantized per call'
            print(f'{rows:4d} rows, {args.layers} layers: {name} {best["q5k"]:8.2f} ms, bf16 F.linear on a copy '
                  f'{best["bf16"]:8.2f} ms ({best["bf16"] / best["q5k"]:.2f}x)', flush=True)


if __name__ == '__main__':
    main()
