"""What an fp32 model's batch invariance costs: the native fixed-order fp32 GEMM (each row's sums in one order
whatever the number of rows), ``fp32_packed_linear`` (fp32 models' layers, LM head and routers, on the packed
weight), against torch's fp32 ``F.linear`` (its kernel, and order, picked by the number of rows) on the default
model's projections (SmolLM2-135M: hidden 576, q/k/v 960, MLP 1536, 30 layers, a tied LM head of 49,152), one
thread, the calling thread's CPU time, the two alternating, best of the rounds. ``--isa avx2`` runs the packed
kernel's AVX2 build (what a CPU without AVX-512 runs; an AVX-512 CPU builds both).

    python benchmark/fp32_linear_cpu.py [--rows 1,24,256] [--rounds 5] [--isa avx512|avx2]

Prints each projection's ms per call and, per row count, a step's total (30 layers' four projections plus the LM
head, which runs on the last position of each prompt in prefill, here one row) and the packed kernel's ratio to
torch's.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu

LAYERS = 30
# name -> (outputs, inputs) of the default model's projections
SHAPES = {'qkv': (960, 576), 'o': (576, 576), 'gate_up': (3072, 576), 'down': (576, 1536), 'lm_head': (49152, 576)}


def ms_per_call(fn, x: torch.Tensor, weight: torch.Tensor, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn(x, weight)
    return 1e3 * (time.thread_time() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rows', default='1,24,256')
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--isa', default=None, help="the packed kernel's instruction set (default: the widest built)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    native = cpu.fp32_gemm()
    if native is None:
        raise SystemExit('fp32_packed_linear needs AVX-512, or AVX2 with FMA')
    isa = args.isa or native.fp32_packed_linear_isas()[0]
    if isa not in native.fp32_packed_linear_isas():
        raise SystemExit(f'fp32_packed_linear is built here for {", ".join(native.fp32_packed_linear_isas())}')
    print(f'packed: fp32_packed_linear on {isa}')
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in SHAPES.items()}
    packed = {id(w): native.pack_fp32_weight(w) for w in weights.values()}
    kernels = {'torch': lambda x, w: F.linear(x, w),
               'packed': lambda x, w: native.fp32_packed_linear(x, packed[id(w)], w.shape[0], None, isa)}
    print('| rows | projection | torch ms | packed ms | packed / torch |\n| --- | --- | --- | --- | --- |')
    for rows in map(int, args.rows.split(',')):
        totals = {name: 0.0 for name in kernels}
        for proj, weight in weights.items():
            m = 1 if proj == 'lm_head' and rows > 24 else rows
            x = torch.randn(m, weight.shape[1], generator=g)
            calls = max(1, int(2e6 / (m * weight.numel()) + 1))
            times = {name: [] for name in kernels}
            for _ in range(args.rounds):
                for name, fn in kernels.items():
                    times[name].append(ms_per_call(fn, x, weight, calls))
            best = {name: min(t) for name, t in times.items()}
            for name in kernels:
                totals[name] += best[name] * (1 if proj == 'lm_head' else LAYERS)
            print(f"| {m} | {proj} | {best['torch']:.3f} | {best['packed']:.3f} | "
                  f"{best['packed'] / best['torch']:.2f} |", flush=True)
        print(f"| {rows} | step (30 layers + LM head) | {totals['torch']:.2f} | {totals['packed']:.2f} | "
              f"{totals['packed'] / totals['torch']:.2f} |", flush=True)


if __name__ == '__main__':
    main()
