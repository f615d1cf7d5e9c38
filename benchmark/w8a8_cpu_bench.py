"""The native W8A8 GEMM (AVX512-VNNI, activations quantized per token in the same call) against the native
bf16 GEMM (AVX512-BF16) on the default model's projections, at decode (1-64 rows) and prefill (512 rows)
sizes, and against the torch reference (``torch._int_mm``) that CPUs without VNNI run.

    python benchmark/w8a8_cpu_bench.py [--layers 30] [--repeat 5]

Each shape runs on ``--layers`` distinct weights in turn, as a decode step does, so the weights stream
from memory rather than from cache; a figure is the median call of the best of ``--repeat`` passes.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.w8a8 import quantize_weight, w8a8_linear
from lmdeploy.pytorch.nn.quant.w8a8 import NativeW8A8Kernel

# SmolLM2-135M: (name, in_features, out_features)
SHAPES = [('qkv_proj', 576, 960), ('o_proj', 576, 576), ('gate_up_proj', 576, 3072), ('down_proj', 1536, 576)]
ROWS = [1, 8, 16, 32, 64, 512]


def best_us(calls: list, repeat: int) -> float:
    """The median call of the best of ``repeat`` passes over ``calls``: robust to the calls that another
    process on the same cores interrupts."""
    best = float('inf')
    for _ in range(repeat):
        times = []
        for call in calls:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        best = min(best, statistics.median(times))
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--layers', type=int, default=30)
    parser.add_argument('--repeat', type=int, default=5)
    args = parser.parse_args()
    bf16, int8 = cpu.bf16_gemm(), cpu.int8_gemm()
    if bf16 is None or int8 is None:
        raise SystemExit('needs the native bf16 (AVX512-BF16, no AMX) and int8 (AVX512-VNNI) GEMMs')
    cpu.bind_worker_threads()
    print(f'{torch.get_num_threads()} threads; microseconds per call (median call of the best of {args.repeat} '
          f'passes), {args.layers} distinct weights per shape')
    print(f'{"shape":>14} {"rows":>5} {"bf16":>9} {"w8a8":>9} {"speedup":>8} {"torch ref":>10}')
    for name, k, n in SHAPES:
        weights = [torch.randn(n, k) * 0.05 for _ in range(args.layers)]
        packed_bf16 = [bf16.pack_bf16_weight(w.bfloat16()) for w in weights]
        quantized = [quantize_weight(w) for w in weights]
        kernels = [NativeW8A8Kernel(q, s) for q, s in quantized]
        for rows in ROWS:
            x = torch.randn(rows, k).bfloat16()
            t_bf16 = best_us([lambda p=p: bf16.bf16_linear(x, p) for p in packed_bf16], args.repeat)
            t_int8 = best_us([lambda kern=kern: kern(x, None) for kern in kernels], args.repeat)
            t_ref = best_us([lambda q=q, s=s: w8a8_linear(x, q, s) for q, s in quantized[:4]], 2)
            print(f'{name:>14} {rows:5d} {t_bf16:9.1f} {t_int8:9.1f} {t_bf16 / t_int8:7.2f}x {t_ref:10.1f}',
                  flush=True)


if __name__ == '__main__':
    main()
