"""The native 4-bit GEMV of small steps (``kernels/cpu/linear_int4.cpp``) against torch, its grid against
gguf's Q4_1 dequantization, the layers that choose it, and the 8-bit GEMV of the LM head (``linear_q8.cpp``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.embedding import LMHead
from lmdeploy.pytorch.nn.linear import GateUpLinear, Linear
from lmdeploy.pytorch.nn.quant import LinearOptions
from lmdeploy.pytorch.nn.quant.dense import DenseKernel
from lmdeploy.pytorch.nn.quant.int4_cpu import (INT4_GROUP, LEAST_SQUARES_CHUNK, NativeInt4Kernel,
                                                SmallStepInt4Kernel, TorchInt4Kernel, least_squares_grid, pack_int4)
from lmdeploy.pytorch.nn.quant.q8_cpu import pack_q8, q8_grid


@pytest.fixture(scope='module')
def gemv():
    module = cpu.int4_gemv()
    if module is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    return module


def random_grid(out_features: int, in_features: int):
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    scale = (torch.rand(out_features, in_features // INT4_GROUP) * 0.02 + 1e-3).half()
    minimum = (torch.randn(out_features, in_features // INT4_GROUP) * 0.1).half()
    return codes, scale, minimum


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    groups = codes.float().view(codes.shape[0], -1, INT4_GROUP)
    return (groups * scale.float()[..., None] + minimum.float()[..., None]).view(codes.shape)


@pytest.mark.parametrize('rows', [1, 2, 5])
@pytest.mark.parametrize('out_features,in_features', [(16, 32), (48, 576), (960, 576), (576, 1536)])
@pytest.mark.parametrize('with_bias', [False, True])
def test_int4_linear_matches_fp32(gemv, rows, out_features, in_features, with_bias):
    """Every row of x against the fp32 product with the dequantized weight; x may be a strided view."""
    torch.manual_seed(0)
    codes, scale, minimum = random_grid(out_features, in_features)
    x = torch.randn(rows, in_features + 8).bfloat16()[:, :in_features]
    bias = torch.randn(out_features) if with_bias else None
    out = gemv.int4_linear(x, *pack_int4(codes, scale, minimum), bias)
    expected = F.linear(x.float(), dequantize(codes, scale, minimum), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize('rows', [1, 3])
def test_int4_gate_up_silu(gemv, rows):
    torch.manual_seed(0)
    intermediate, hidden = 96, 64
    codes, scale, minimum = random_grid(2 * intermediate, hidden)
    x = torch.randn(rows, hidden).bfloat16()
    packed, scales = pack_int4(codes, scale, minimum, gate_up=True)
    gate, up = F.linear(x.float(), dequantize(codes, scale, minimum)).chunk(2, dim=-1)
    torch.testing.assert_close(gemv.int4_gate_up_silu(x, packed, scales).float(), F.silu(gate) * up,
                               atol=2e-2, rtol=1e-2)
    kernel = NativeInt4Kernel(packed, scales, gate_up=True)  # a plain call gives gate then up, in order
    torch.testing.assert_close(kernel(x, None).float(), torch.cat((gate, up), -1), atol=2e-2, rtol=1e-2)


def test_least_squares_grid_recovers_a_gguf_q4_1_tensor():
    """A tensor quantized to Q4_1 by gguf, dequantized by gguf and loaded in bf16 (as the engine loads the
    default model): the fitted grid gives every code back, and its fp16 scales and minimums reproduce gguf's
    weights closer than the bf16 copy does (1.9x on average here; a group's fit can round to a neighbour
    of the file's fp16 values)."""
    gguf = pytest.importorskip('gguf')
    rng = np.random.default_rng(0)
    source = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    q4_1 = gguf.quants.quantize(source, gguf.GGMLQuantizationType.Q4_1)
    reference = torch.from_numpy(gguf.quants.dequantize(q4_1, gguf.GGMLQuantizationType.Q4_1).copy())
    loaded = reference.bfloat16()
    codes, scale, minimum = least_squares_grid(loaded)
    blocks = torch.from_numpy(q4_1.reshape(64, 256 // INT4_GROUP, 20).copy())
    file_codes = torch.stack((blocks[..., 4:] & 15, blocks[..., 4:] >> 4), dim=-2).reshape(64, 256)
    assert torch.equal(codes, file_codes)
    ours = (dequantize(codes, scale, minimum) - reference).abs()
    bf16_copy = (loaded.float() - reference).abs()
    assert ours.mean() < bf16_copy.mean() * 0.7 and ours.max() <= bf16_copy.max()


def test_least_squares_grid_fits_each_row_as_if_alone():
    """The grid is fitted a chunk of rows at a time: rows on both sides of a chunk's end (and a last, partial
    chunk) get the codes, scales and minimums of the row fitted alone, bit for bit."""
    in_features = 4 * INT4_GROUP
    rows = LEAST_SQUARES_CHUNK // in_features
    weight = (torch.randn(2 * rows + 3, in_features) * 0.05).bfloat16()
    fitted = least_squares_grid(weight)
    for row in (0, rows - 1, rows, 2 * rows + 2):
        alone = least_squares_grid(weight[row:row + 1])
        assert all(torch.equal(part[row:row + 1], part_alone) for part, part_alone in zip(fitted, alone))


def test_small_steps_run_the_native_gemv(gemv):
    """decode_int4's copy of a bf16 layer: steps of up to small_step_rows rows on the native GEMV (gate and up
    with their SiLU in its epilogue), larger ones on the bf16 kernel; fp32 layers keep F.linear."""
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=True).bfloat16()
    gate_up = GateUpLinear(64, 48).bfloat16()
    for module in (layer, gate_up):
        torch.nn.init.normal_(module.weight, std=0.1)
    torch.nn.init.normal_(layer.bias)
    weights = layer.weight.detach().clone(), gate_up.weight.detach().clone()
    for module in (layer, gate_up):
        module.finalize(LinearOptions(small_step_int4=True))
        assert isinstance(module.kernel, SmallStepInt4Kernel) and isinstance(module.kernel.small, NativeInt4Kernel)
        assert isinstance(module.kernel.large, DenseKernel)
    rows = layer.kernel.small_step_rows
    small, big = torch.randn(rows, 64).bfloat16(), torch.randn(rows + 1, 64).bfloat16()
    codes, scale, minimum = least_squares_grid(weights[0])
    torch.testing.assert_close(layer(small).float(), F.linear(small.float(), dequantize(codes, scale, minimum),
                                                              layer.bias.float()), atol=2e-2, rtol=1e-2)
    assert torch.equal(layer(big), F.linear(big, weights[0], layer.bias))
    gate, up = F.linear(small.float(), dequantize(*least_squares_grid(weights[1]))).chunk(2, dim=-1)
    torch.testing.assert_close(gate_up(small).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)
    fp32 = Linear(64, 32)
    fp32.finalize(LinearOptions(small_step_int4=True))
    assert isinstance(fp32.kernel, DenseKernel), 'fp32 weights keep the exact path'


def test_without_the_native_gemv_small_steps_run_torch_int4(monkeypatch):
    """The fallback where the GEMV was not built (no AVX512-BF16, or no compiler): torch's int4 kernel."""
    monkeypatch.setattr(cpu, 'int4_gemv', lambda: None)
    torch.manual_seed(0)
    layer = Linear(64, 32).bfloat16()
    torch.nn.init.normal_(layer.weight, std=0.1)
    weight = layer.weight.detach().clone()
    layer.finalize(LinearOptions(small_step_int4=True))
    assert isinstance(layer.kernel.small, TorchInt4Kernel)
    x = torch.randn(1, 64).bfloat16()
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), weight.float()), atol=0.1, rtol=0.05)


@pytest.mark.parametrize('rows', [1, 3])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_q8_linear_matches_fp32(rows, dtype):
    """The LM head's 8-bit GEMV against the fp32 product with the dequantized weight."""
    if cpu.q8_gemv() is None:
        pytest.skip('the native 8-bit GEMV needs AVX-512')
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    codes, scale = q8_grid(weight)
    x = torch.randn(rows, 128).to(dtype)
    expected = F.linear(x.float(), codes.float() * scale.float().repeat_interleave(INT4_GROUP, 1))
    out = cpu.q8_gemv().q8_linear(x, *pack_q8(codes, scale))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_lm_head_takes_8_bits_only_for_a_q8_0_table():
    """A table quantized to Q8_0 by gguf and loaded in bf16 gets the 8-bit copy, whose logits match the bf16
    table's; a plain random bf16 table (which 8 bits would round) keeps the fp16 copy."""
    gguf = pytest.importorskip('gguf')
    if cpu.q8_gemv() is None:
        pytest.skip('the native 8-bit GEMV needs AVX-512')
    rng = np.random.default_rng(0)
    source = (rng.standard_normal((256, 64)) * 0.05).astype(np.float32)
    q8_0 = gguf.quants.quantize(source, gguf.GGMLQuantizationType.Q8_0)
    table = torch.from_numpy(gguf.quants.dequantize(q8_0, gguf.GGMLQuantizationType.Q8_0).copy()).bfloat16()
    hidden = torch.randn(1, 64).bfloat16()
    for weight, eight_bits in ((table, True), (torch.from_numpy(source).bfloat16(), False)):
        head = LMHead(64, 256)
        head.weight.data = weight.clone()
        head.enable_small_step_copy()
        assert (head.q8 is not None) == eight_bits and (head.fp16 is None) == eight_bits
        torch.testing.assert_close(head(hidden), F.linear(hidden.float(), weight.float()), atol=2e-3, rtol=1e-2)
