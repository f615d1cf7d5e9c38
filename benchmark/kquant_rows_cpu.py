"""Where a GGUF layer's native GEMV stops paying on this CPU: each K-quant kernel's two paths by step size, the
GEMV on the file's blocks and the same copy dequantized to bf16 for the bf16 GEMM, which the kernel picks between at
``gemv_max_rows(kind)`` rows (``nn/quant/q6k_cpu.py``). Q4_K, Q5_K, Q6_K and Q8_0 layers of ``--shapes``' widths
(TinyLlama's by default: q/k/v 2560 x 2048, o 2048 x 2048, gate-and-up 11264 x 2048, down 2048 x 5632; Q4_K's
gate-and-up with its SiLU), random blocks, ``--layers`` of them so that a pass reads far more than the L3. One thread
by default, timed by its CPU time (``time.thread_time``) so that other jobs on a shared machine take time slices but
not figures; with ``--threads`` above one, the process's CPU time (all threads' work) and the wall time (which other
jobs inflate) are both printed. Best of repeats, the two paths alternating.

``--no-amx`` emulates a CPU without AMX (the CI's EPYC with AVX512-BF16): run it in a fresh process with
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` set before torch loads (oneDNN's GEMMs then run on ``avx512_core_bf16``;
check with ``ONEDNN_VERBOSE=1``); torch's ``_is_amx_tile_supported``, which the engine asks, reads the CPU and not
that variable, so ``--no-amx`` makes it answer False in this process::

    PYTHONPATH=. python benchmark/kquant_rows_cpu.py --rows 8,16,32,64
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 PYTHONPATH=. python benchmark/kquant_rows_cpu.py --no-amx --rows 8,16,32,64

Run alone, glibc hands each dequantized copy the pages the previous call freed; in the engine other tensors come
between, and a copy mostly lands on fresh pages, whose first touch costs as much as the dequantization (about 60 ms
more per 2 layers here). Set ``MALLOC_MMAP_THRESHOLD_=65536`` to give every copy fresh pages, as the engine does
(its end-to-end figures, ``benchmark/kquant_gguf_cpu.py``, side with this mode).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.activation import silu_and_mul
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv, q8_0_unpack
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv
from lmdeploy.pytorch.nn.quant.q5k_cpu import Q5KGemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import GEMV_MAX_ROWS, Q6KGemv, gemv_max_rows

# a decoder layer's projections (outputs, inputs, gate-and-up): q/k/v, o, gate-and-up, down
SHAPES = {
    'tinyllama': [(2560, 2048, False), (2048, 2048, False), (11264, 2048, True), (2048, 5632, False)],
    'gemma3-270m': [(1536, 640, False), (640, 1024, False), (4096, 640, True), (640, 2048, False)],
    'qwen2.5-1.5b': [(2048, 1536, False), (1536, 1536, False), (17920, 1536, True), (1536, 8960, False)],
}
# per type: inputs and bytes per block, and the byte offsets of its fp16 scales
BLOCKS = {'q4k': (256, 144, (0, 2)), 'q5k': (256, 176, (0, 2)), 'q6k': (256, 210, (208, )), 'q8_0': (32, 34, (0, ))}


def random_blocks(rng: np.random.Generator, kind: str, rows: int, inputs: int) -> torch.Tensor:
    """Random ``[rows, inputs / B, bytes]`` blocks of ``kind`` with small fp16 scales."""
    block_inputs, block_bytes, scale_offsets = BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows, inputs // block_inputs, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        scale = rng.uniform(1e-5, 1e-4, (rows, inputs // block_inputs, 1)).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8)
    return torch.from_numpy(blocks)


def set_bounds(no_amx: bool, bounds: str = '') -> None:
    """Before the model loads: the engine told the CPU has no AMX (``no_amx``; torch's ``_is_amx_tile_supported``
    answers False) and the GEMVs' bounds set to ``bounds`` (``q4k=32,q6k=16``, whatever the CPU)."""
    if no_amx:
        torch.cpu._is_amx_tile_supported = lambda: False
    for kind, rows in (item.split('=') for item in bounds.split(',') if item):
        GEMV_MAX_ROWS[kind] = (int(rows), int(rows))


def kernel_of(kind: str, blocks: torch.Tensor, gate_up: bool):
    """The engine's CPU kernel of a ``kind`` layer's blocks."""
    if kind == 'q4k':
        return Q4KGemv.of_blocks(blocks, gate_up).layer_kernel()
    if kind == 'q5k':
        return Q5KGemv.of(blocks).layer_kernel()
    if kind == 'q6k':
        return Q6KGemv.of(blocks).layer_kernel()
    return Q8_0Gemv.of(*q8_0_unpack(blocks)).layer_kernel()


def run_layers(layers: list, xs: dict[int, torch.Tensor], max_gemv_rows: int) -> tuple[float, float]:
    """CPU seconds (this thread's with one thread, else the process's) and wall seconds of one pass over ``layers``
    with their kernels' bound set to ``max_gemv_rows``."""
    cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
    start, wall = cpu_clock(), time.perf_counter()
    for kernel, gate_up, inputs in layers:
        kernel.small_step_rows = max_gemv_rows  # outside an engine step the kernel chooses by it
        if gate_up:  # as the MLP runs it: the GEMV's SiLU epilogue, else SiLU-and-mul after
            if kernel.gate_up_silu(xs[inputs], None) is None:
                silu_and_mul(kernel(xs[inputs], None))
        else:
            kernel(xs[inputs], None)
    return cpu_clock() - start, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--kinds', default='q4k,q5k,q6k,q8_0', help='layer types, comma-separated')
    parser.add_argument('--rows', default='8,16,24,32,48,64,96,128', help='step sizes, comma-separated')
    parser.add_argument('--shapes', choices=sorted(SHAPES), default='tinyllama', help="a decoder layer's widths")
    parser.add_argument('--layers', type=int, default=2)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--no-amx', action='store_true', help='the engine told the CPU has no AMX (see above)')
    args = parser.parse_args()
    set_bounds(args.no_amx)
    if cpu.int4_gemv() is None or cpu.q8_gemv() is None:
        raise SystemExit('the native GEMVs need AVX512-BF16')
    torch.set_num_threads(args.threads)
    isa = os.environ.get('ONEDNN_MAX_CPU_ISA', 'as the CPU')
    print(f'ONEDNN_MAX_CPU_ISA {isa}, engine sees AMX: {cpu.onednn_amx()}', flush=True)
    rng = np.random.default_rng(0)
    for kind in args.kinds.split(','):
        layers = [(kernel_of(kind, random_blocks(rng, kind, rows, inputs), gate_up), gate_up, inputs)
                  for _ in range(args.layers) for rows, inputs, gate_up in SHAPES[args.shapes]]
        for rows in (int(r) for r in args.rows.split(',')):
            xs = {inputs: torch.randn(rows, inputs).bfloat16() for _, inputs, _ in SHAPES[args.shapes]}
            gemv = dequantized = (float('inf'), float('inf'))
            for _ in range(args.repeats):
                gemv = tuple(map(min, gemv, run_layers(layers, xs, rows)))
                dequantized = tuple(map(min, dequantized, run_layers(layers, xs, 0)))
            wall = (f'; wall {gemv[1] * 1e3:.2f} / {dequantized[1] * 1e3:.2f} ms ({gemv[1] / dequantized[1]:.2f}x)'
                    if args.threads > 1 else '')
            print(f'{kind:5s} {rows:4d} rows, {args.layers} layers: GEMV {gemv[0] * 1e3:8.2f} ms, dequantized '
                  f'{dequantized[0] * 1e3:8.2f} ms ({gemv[0] / dequantized[0]:.2f}x){wall}; bound now '
                  f'{gemv_max_rows(kind)}', flush=True)


if __name__ == '__main__':
    main()
