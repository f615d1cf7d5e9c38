"""A block-quantized layer's large steps (``kquant_dequantized_linear``, ``mxfp4_dequantized_linear``,
``kernels/cpu/dequantized_linear.h``): with AVX512-BF16 and no AMX each bf16 row equals, bit for bit, the native bf16
GEMM on the freshly dequantized weight, alone or among other rows (so a prompt's prefill does not depend on its
batch); elsewhere the weight dequantized into the calling thread's reused scratch gives exactly what ``F.linear`` on
a fresh copy gives. Either way whatever layers ran before it and on whichever thread. Q8_0's native dequantization
gives exactly gguf's weights in bf16."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from helpers import large_step_reference
from test_gguf_q4km import random_blocks

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv, q8_0_unpack
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv
from lmdeploy.pytorch.nn.quant.q5k_cpu import Q5KGemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import KQuantDequantized, Q6KGemv

# two shapes in turn: the second grows the scratch, the first then runs on a part of it
SHAPES = [(64, 768), (128, 1024), (64, 768), (96, 512)]
QTYPES = {'q4k': Q.Q4_K, 'q5k': Q.Q5_K, 'q6k': Q.Q6_K}
ROW_COUNTS = (1, 2, 5, 17, 64)


def q8_0_blocks(rows: int, inputs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 blocks ``[rows, inputs / 32, 34]`` (every code from -128 to 127, fp16 scales from 2^-20 to 2^4)
    and gguf's dequantization of them (fp32)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, inputs // 32, 34), dtype=np.uint8)
    scales = np.exp2(rng.uniform(-20, 4, (rows, inputs // 32, 1))).astype(np.float16)
    blocks[..., :2] = scales.view(np.uint8)
    expected = dequantize(blocks.reshape(rows, -1), Q.Q8_0).astype(np.float32)
    return torch.from_numpy(blocks), torch.from_numpy(expected)


def kernel_of(kind: str, blocks: torch.Tensor, gate_up: bool):
    if kind == 'q8_0':
        return Q8_0Gemv.of(*q8_0_unpack(blocks))
    if kind == 'q4k':
        return Q4KGemv.of_blocks(blocks, gate_up)
    return Q5KGemv.of(blocks) if kind == 'q5k' else Q6KGemv.of(blocks)


def codes_of(kind: str, kernel) -> torch.Tensor:
    return kernel.codes if kind == 'q5k' else kernel.packed


def fresh_weight(kind: str, kernel, gate_up: bool) -> torch.Tensor:
    """The layer's weight, newly dequantized to bf16 (``[gate; up]`` with gate_up)."""
    native = cpu.native()
    if kind == 'q4k':
        return native.q4k_dequantize(kernel.packed, kernel.scales, gate_up)
    name = 'q8' if kind == 'q8_0' else kind
    return getattr(native, f'{name}_dequantize')(codes_of(kind, kernel), kernel.scales)


def fresh_linear(kind: str, kernel, x: torch.Tensor, bias: torch.Tensor | None, gate_up: bool) -> torch.Tensor:
    return large_step_reference(x, fresh_weight(kind, kernel, gate_up), bias)


def assert_rows_are_the_gemm_s(large_step, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``large_step(rows)`` at 1, 2, 5, 17 and 64 rows equals the native GEMM on ``weight`` bit for bit, and each
    row run alone equals the same row among 64."""
    together = large_step(x)
    for rows in ROW_COUNTS:
        assert torch.equal(large_step(x[:rows]), large_step_reference(x[:rows], weight, bias)), rows
    assert all(torch.equal(large_step(x[i:i + 1]), together[i:i + 1]) for i in range(x.shape[0]))


def layers(kind: str, gate_up: bool) -> list:
    built = {'q4k': cpu.int4_gemv, 'q5k': cpu.q5k_gemv, 'q6k': cpu.q6k_gemv, 'q8_0': cpu.q8_gemv}[kind]()
    if built is None:
        pytest.skip('the native K-quant and Q8_0 kernels need AVX512-BF16')
    make = q8_0_blocks if kind == 'q8_0' else lambda *shape, seed: random_blocks(QTYPES[kind], *shape, seed=seed)
    return [kernel_of(kind, make(rows, inputs, seed=i)[0], gate_up) for i, (rows, inputs) in enumerate(SHAPES)]


def test_q8_0_dequantization_is_gguf_s():
    """The native Q8_0 dequantization (``q8_dequantize``, from ``pack_q8``'s layout) gives gguf's weights rounded
    to bf16, bit for bit: all 256 codes, scales over 24 octaves."""
    if cpu.q8_gemv() is None:
        pytest.skip('the native Q8_0 kernels need AVX512-BF16')
    blocks, expected = q8_0_blocks(96, 1024, seed=3)
    kernel = kernel_of('q8_0', blocks, False)
    assert torch.equal(cpu.native().q8_dequantize(kernel.packed, kernel.scales), expected.bfloat16())


@pytest.mark.parametrize('kind,gate_up', [('q4k', False), ('q4k', True), ('q5k', False), ('q6k', False),
                                          ('q8_0', False)])
def test_large_steps_equal_the_fresh_dequantization(kind, gate_up):
    """Steps above the bound, several sizes, layers of different shapes in a row: each output bit-identical to the
    large step on a fresh copy (``large_step_reference``), and still so after the later layers ran."""
    kernels = layers(kind, gate_up)
    g = torch.Generator().manual_seed(0)
    outs = []
    for kernel, (rows_out, inputs) in zip(kernels, SHAPES):
        bias = None if gate_up else torch.randn(rows_out, generator=g).bfloat16()
        layer = kernel.layer_kernel()  # outside an engine step: above its bound, dequantized
        for rows in (layer.small_step_rows + 1, 2 * layer.small_step_rows + 5, 200):
            x = torch.randn(rows, inputs, generator=g).bfloat16()
            out = layer(x, bias)
            expected = fresh_linear(kind, kernel, x, bias, gate_up)
            assert torch.equal(out, expected), (kind, rows, inputs)
            outs.append((out, expected))
    assert all(torch.equal(out, expected) for out, expected in outs)


def native_dequantizing_gemm():
    native = cpu.native()
    if native is None or not native.dequantizing_gemm_available():
        pytest.skip('large steps take the native bf16 GEMM with AVX512-BF16 and without AMX')
    return native


@pytest.mark.parametrize('kind,gate_up', [('q4k', False), ('q4k', True), ('q5k', False), ('q6k', False),
                                          ('q8_0', False)])
def test_rows_equal_the_native_gemm_whatever_their_number(kind, gate_up):
    """128 outputs of 1024 inputs and 96 of 512 (a last group of two panels; gate_up: gate and up of half each),
    with a bias: every row count the GEMM's bits, a row alone those among others."""
    native = native_dequantizing_gemm()
    g = torch.Generator().manual_seed(1)
    for kernel, (rows_out, inputs) in list(zip(layers(kind, gate_up), SHAPES))[1:4:2]:
        x = torch.randn(64, inputs, generator=g).bfloat16()
        bias = torch.randn(rows_out, generator=g).bfloat16()
        assert_rows_are_the_gemm_s(
            lambda rows: native.kquant_dequantized_linear(rows, kind, codes_of(kind, kernel), kernel.scales, bias,
                                                          gate_up), fresh_weight(kind, kernel, gate_up), x, bias)


def test_mxfp4_rows_equal_the_native_gemm_whatever_their_number():
    """MXFP4 (gpt-oss's experts): 80 outputs of 1024 inputs, every code, scales over 16 octaves."""
    native = native_dequantizing_gemm()
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (80, 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(119, 135, (80, 32), dtype=torch.uint8, generator=g)
    x = torch.randn(64, 1024, generator=g).bfloat16()
    bias = torch.randn(80, generator=g).bfloat16()
    assert_rows_are_the_gemm_s(lambda rows: native.mxfp4_dequantized_linear(rows, blocks, scales, bias),
                               native.mxfp4_dequantize(blocks, scales, torch.bfloat16), x, bias)


def test_fp32_activations_and_threads():
    """fp32 activations get the bf16 weights in fp32, as before; two threads running different layers at once each
    get their own scratch."""
    kernels = layers('q4k', False)
    x = torch.randn(40, 768)
    assert torch.equal(cpu.native().kquant_dequantized_linear(x, 'q4k', kernels[0].packed, kernels[0].scales),
                       fresh_linear('q4k', kernels[0], x, None, False))
    inputs = {id(k): torch.randn(80, k.scales.shape[1] * 256).bfloat16() for k in kernels}
    expected = {id(k): fresh_linear('q4k', k, inputs[id(k)], None, False) for k in kernels}
    dequantized = {id(k): KQuantDequantized('q4k', k.packed, k.scales) for k in kernels}
    mismatches = []

    def run(own: list) -> None:
        for _ in range(5):
            for kernel in own:
                if not torch.equal(dequantized[id(kernel)](inputs[id(kernel)], None), expected[id(kernel)]):
                    mismatches.append(kernel)

    threads = [threading.Thread(target=run, args=(kernels[i::2], )) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not mismatches


def test_bad_kinds_are_refused():
    kernel = layers('q6k', False)[0]
    x = torch.randn(40, 768).bfloat16()
    with pytest.raises(RuntimeError, match="a GGUF layer's kind is 'q4k', 'q5k', 'q6k' or 'q8_0', not 'q3k'"):
        cpu.native().kquant_dequantized_linear(x, 'q3k', kernel.packed, kernel.scales)
    with pytest.raises(RuntimeError, match="only Q4_K's tiles alternate gate and up rows"):
        cpu.native().kquant_dequantized_linear(x, 'q6k', kernel.packed, kernel.scales, None, True)
