"""What bf16 layers off the native GEMM's panels cost on their padded native panels (``native_bf16_kernel``) against
oneDNN's GEMM on its blocked weight (``OneDnnKernel``), which ran them before: a gate-and-up layer whose gate and
up rows are not a multiple of 16 each (native: zero rows pad each half, SiLU-and-mul in the GEMM's epilogue;
oneDNN: its product, then ``silu_and_mul``), and layers of an odd number of inputs (native: a zero column, x's rows
padded for each call). Per call, one thread, the thread's CPU time, the best of 5 runs (of at least 5 calls, about
20 ms), the two kernels alternating
3 times in one process (random N(0, 0.02) weights and N(0, 1) rows), as ``router_gemm_cpu.py``.

    python benchmark/bf16_off_panels_cpu.py
"""
from __future__ import annotations

import torch
from router_gemm_cpu import per_call_us

from lmdeploy.pytorch.kernels.activation import silu_and_mul
from lmdeploy.pytorch.nn.quant.cpu_bf16 import OneDnnKernel, native_bf16_kernel

# (outputs, inputs, gate_up): a gate and an up of 24 and of 1000 rows each, then odd K
SHAPES = ((48, 2048, True), (2000, 1024, True), (48, 2049, True), (576, 2049, False), (2049, 576, False))
ROWS = (1, 24, 128, 512)


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print('| layer | rows | native, padded (us) | oneDNN (us) | native / oneDNN |')
    print('| --- | --- | --- | --- | --- |')
    for outputs, inputs, gate_up in SHAPES:
        weight = (torch.randn(outputs, inputs, generator=g) * 0.02).bfloat16()
        native = native_bf16_kernel(weight, gate_up)
        if native is None:
            raise SystemExit('the native bf16 GEMM does not run on this CPU (AVX512-BF16 without AMX)')
        onednn = OneDnnKernel(torch.ops.mkldnn._reorder_linear_weight(weight))
        name = f'gate-and-up 2 x {outputs // 2} x {inputs}' if gate_up else f'{outputs} x {inputs}'
        for rows in ROWS:
            calls = max(5, int(2e8 / (outputs * inputs * rows)))  # runs of about 20 ms at the native GEMM's pace
            x = torch.randn(rows, inputs, generator=g).bfloat16()
            ours = (lambda: native.gate_up_silu(x, None)) if gate_up else (lambda: native(x, None))
            theirs = (lambda: silu_and_mul(onednn(x, None))) if gate_up else (lambda: onednn(x, None))
            times: dict[str, list[float]] = {'native': [], 'onednn': []}
            for _ in range(3):
                times['native'].append(per_call_us(ours, calls))
                times['onednn'].append(per_call_us(theirs, calls))
            a, b = min(times['native']), min(times['onednn'])
            print(f'| {name} | {rows} | {a:.2f} | {b:.2f} | {a / b:.2f} |', flush=True)


if __name__ == '__main__':
    main()
