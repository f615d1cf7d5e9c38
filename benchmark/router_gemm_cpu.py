"""What a bf16 router or gate whose outputs do not fill the native GEMM's 16-row panels costs on its padded native
panels (``native_bf16_kernel``) against oneDNN's GEMM on its blocked weight (``OneDnnKernel``, which ran it before):
per call, one thread, the thread's CPU time, the best of 5 runs of 2,000 calls, the two kernels alternating 3 times
in one process (random N(0, 0.02) weights and N(0, 1) rows).

    python benchmark/router_gemm_cpu.py
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lmdeploy.pytorch.nn.quant.cpu_bf16 import OneDnnKernel, native_bf16_kernel

SHAPES = ((60, 1024), (8, 2048), (1, 2048), (64, 1024))  # (outputs, hidden): Qwen1.5-MoE-like, Mixtral-like, a gate
ROWS = (1, 24, 128)


def per_call_us(call: Callable[[], object], calls: int = 2000, runs: int = 5) -> float:
    """The best of ``runs`` of ``calls`` calls, thread CPU microseconds a call."""
    best = float('inf')
    for _ in range(runs):
        start = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    return best


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print('| outputs x hidden | rows | native, padded (us) | oneDNN (us) | native / oneDNN |')
    print('| --- | --- | --- | --- | --- |')
    for outputs, hidden in SHAPES:
        weight = (torch.randn(outputs, hidden, generator=g) * 0.02).bfloat16()
        native = native_bf16_kernel(weight)
        if native is None:
            raise SystemExit('the native bf16 GEMM does not run on this CPU (AVX512-BF16 without AMX)')
        onednn = OneDnnKernel(torch.ops.mkldnn._reorder_linear_weight(weight))
        for rows in ROWS:
            x = torch.randn(rows, hidden, generator=g).bfloat16()
            times: dict[str, list[float]] = {'native': [], 'onednn': []}
            for _ in range(3):
                times['native'].append(per_call_us(lambda: native(x, None)))
                times['onednn'].append(per_call_us(lambda: onednn(x, None)))
            ours, theirs = min(times['native']), min(times['onednn'])
            print(f'| {outputs} x {hidden} | {rows} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |', flush=True)


if __name__ == '__main__':
    main()
