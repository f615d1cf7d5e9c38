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

``--before TREE`` compares the dequantized path (prefill rows) of two source trees, ``TREE`` and ``--after``
(this one by default), each round a fresh process per tree, the trees alternating, ``--rounds`` of them; it prints
each tree's best and the ratio after / before, beside the GEMV of the after tree. A prefill of one to three
tokens::

    PYTHONPATH=. python benchmark/kquant_rows_cpu.py --before /tmp/tree --kinds q4k,q6k,q8_0 --rows 1,2,3 --layers 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

import lmdeploy
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


def measure(args: argparse.Namespace) -> dict[str, tuple[float, float, float, float]]:
    """Per ``kind rows``: the best CPU and wall seconds of the GEMV's pass, then of the dequantized path's."""
    set_bounds(args.no_amx)
    if cpu.int4_gemv() is None or cpu.q8_gemv() is None:
        raise SystemExit('the native GEMVs need AVX512-BF16')
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    results = {}
    for kind in args.kinds.split(','):
        layers = [(kernel_of(kind, random_blocks(rng, kind, rows, inputs), gate_up), gate_up, inputs)
                  for _ in range(args.layers) for rows, inputs, gate_up in SHAPES[args.shapes]]
        for rows in (int(r) for r in args.rows.split(',')):
            xs = {inputs: torch.randn(rows, inputs).bfloat16() for _, inputs, _ in SHAPES[args.shapes]}
            gemv = dequantized = (float('inf'), float('inf'))
            for _ in range(args.repeats):
                gemv = tuple(map(min, gemv, run_layers(layers, xs, rows)))
                dequantized = tuple(map(min, dequantized, run_layers(layers, xs, 0)))
            results[f'{kind} {rows}'] = (*gemv, *dequantized)
    return results


def compare_trees(args: argparse.Namespace) -> None:
    """The dequantized path in the trees ``args.before`` and ``args.after``, fresh processes alternating."""
    child = [f'--{name}={getattr(args, name)}' for name in ('kinds', 'rows', 'shapes', 'layers', 'threads', 'repeats')]
    child += ['--json'] + (['--no-amx'] if args.no_amx else [])
    best: dict[str, dict[str, list[float]]] = {'before': {}, 'after': {}}
    for round_ in range(args.rounds):
        for name in ('before', 'after') if round_ % 2 == 0 else ('after', 'before'):
            tree = os.path.abspath(getattr(args, name))
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *child], env=env, capture_output=True,
                                 text=True, check=True).stdout
            got = json.loads(out.splitlines()[-1])
            if not got.pop('lmdeploy').startswith(tree):
                raise SystemExit(f'{name}: lmdeploy was not imported from {tree}')
            print(f'round {round_ + 1} {name}: ' + ', '.join(f'{key} {v[2] * 1e3:.2f} ms' for key, v in got.items()),
                  flush=True)
            for key, v in got.items():
                best[name][key] = list(map(min, best[name].get(key, v), v))
    print(f'| {args.shapes}, {args.layers} layer sets: ms (CPU, best of {args.rounds}) | GEMV | dequantized before '
          '| after | after / before | after / GEMV |\n| --- | --- | --- | --- | --- | --- |')
    for key, after in best['after'].items():
        before = best['before'][key]
        print(f'| {key} rows | {after[0] * 1e3:.2f} | {before[2] * 1e3:.2f} | {after[2] * 1e3:.2f} | '
              f'{after[2] / before[2]:.2f} | {after[2] / after[0]:.2f} |')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--kinds', default='q4k,q5k,q6k,q8_0', help='layer types, comma-separated')
    parser.add_argument('--rows', default='8,16,24,32,48,64,96,128', help='step sizes, comma-separated')
    parser.add_argument('--shapes', choices=sorted(SHAPES), default='tinyllama', help="a decoder layer's widths")
    parser.add_argument('--layers', type=int, default=2)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--no-amx', action='store_true', help='the engine told the CPU has no AMX (see above)')
    parser.add_argument('--before', help='compare the dequantized path with this source tree (see above)')
    parser.add_argument('--after', default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument('--rounds', type=int, default=4)
    parser.add_argument('--json', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.before:
        return compare_trees(args)
    if args.json:
        print(json.dumps({'lmdeploy': lmdeploy.__file__, **measure(args)}))
        return
    isa = os.environ.get('ONEDNN_MAX_CPU_ISA', 'as the CPU')
    print(f'ONEDNN_MAX_CPU_ISA {isa}, engine sees AMX: {cpu.onednn_amx()}', flush=True)
    for key, (gemv, gemv_wall, dequantized, dequantized_wall) in measure(args).items():
        kind, rows = key.split()
        wall = (f'; wall {gemv_wall * 1e3:.2f} / {dequantized_wall * 1e3:.2f} ms ({gemv_wall / dequantized_wall:.2f}x)'
                if args.threads > 1 else '')
        print(f'{kind:5s} {int(rows):4d} rows, {args.layers} layers: GEMV {gemv * 1e3:8.2f} ms, dequantized '
              f'{dequantized * 1e3:8.2f} ms ({gemv / dequantized:.2f}x){wall}; bound now '
              f'{gemv_max_rows(kind)}', flush=True)


if __name__ == '__main__':
    main()
