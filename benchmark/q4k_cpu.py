"""GGUF Q4_K layers on the CPU by step size: the Q4_K GEMV (the file's 6-bit scales, 0.5625 bytes a weight), the
same copy dequantized to bf16 for ``F.linear`` (``q4k_dequantize``, what a Q4_K layer runs above
``gemv_max_rows('q4k')`` rows), and for reference the int4 GEMV on the same codes (an fp16 scale and minimum per 32
weights, 0.625 bytes a weight; what larger steps ran before).

The weights are random Q4_K blocks of the Q4_K_M benchmark file's decoder (``benchmark/make_q4km.py``: TinyLlama's
widths, q/k/v 2560 x 2048, o 2048 x 2048, gate-and-up 11264 x 2048 with its SiLU, down 2048 x 5632), ``--layers``
of them so that a pass reads far more than the L3, as a decode step does. One thread, timed by its CPU time
(``time.thread_time``), so that other jobs on a shared machine take time slices but not figures; best of repeats,
the three alternating::

    PYTHONPATH=. python benchmark/q4k_cpu.py --rows 1,4,64
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.activation import silu_and_mul
from lmdeploy.pytorch.nn.quant.gguf_blocks import q4_k_grid
from lmdeploy.pytorch.nn.quant.int4_cpu import NativeInt4Kernel
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv

SHAPES = [(2560, 2048, False), (2048, 2048, False), (11264, 2048, True), (2048, 5632, False)]


def random_blocks(rng: np.random.Generator, rows: int, inputs: int) -> torch.Tensor:
    """Random Q4_K blocks ``[rows, inputs / 256, 144]`` with small fp16 ``d`` and ``dmin``."""
    blocks = rng.integers(0, 256, (rows, inputs // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = rng.uniform(1e-4, 1e-3, (rows, inputs // 256, 2)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--rows', default='1,4,64', help='step sizes (rows of x), comma-separated')
    parser.add_argument('--layers', type=int, default=8)
    parser.add_argument('--repeats', type=int, default=10)
    args = parser.parse_args()
    if cpu.int4_gemv() is None:
        raise SystemExit('the native GEMVs need AVX512-BF16')
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    layers = [[(random_blocks(rng, rows, inputs), gate_up) for rows, inputs, gate_up in SHAPES]
              for _ in range(args.layers)]
    kernels = {'int4': [[(NativeInt4Kernel.of_grid(q4_k_grid(b), gate_up), gate_up) for b, gate_up in layer]
                        for layer in layers],
               'q4k': [[(Q4KGemv.of_blocks(b, gate_up), gate_up) for b, gate_up in layer]
                       for layer in layers]}
    kernels['dequantized'] = kernels['q4k']
    for rows in (int(r) for r in args.rows.split(',')):
        xs = {inputs: torch.randn(rows, inputs).bfloat16() for inputs in (2048, 5632)}
        best = dict.fromkeys(kernels, float('inf'))
        for _ in range(args.repeats):
            for name, stack in kernels.items():
                start = time.thread_time()
                for layer in stack:
                    for kernel, gate_up in layer:
                        x = xs[kernel.packed.shape[1] * 32]
                        if name == 'dequantized':
                            out = F.linear(x, cpu.native().q4k_dequantize(kernel.packed, kernel.scales, gate_up))
                            silu_and_mul(out) if gate_up else out
                        else:
                            kernel.gate_up_silu(x, None) if gate_up else kernel(x, None)
                best[name] = min(best[name], time.thread_time() - start)
        print(f'{rows:4d} rows, {args.layers} layers: int4 GEMV {best["int4"] * 1e3:7.2f} ms, '
              f'Q4_K GEMV {best["q4k"] * 1e3:7.2f} ms, dequantized + F.linear {best["dequantized"] * 1e3:7.2f} ms',
              flush=True)


if __name__ == '__main__':
    main()
