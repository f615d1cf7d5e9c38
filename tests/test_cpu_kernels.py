"""The native CPU kernels against their torch twins, and the 4-bit weights of small steps."""
from __future__ import annotations

import pytest
import torch
from helpers import fp32_kernel

from lmdeploy.pytorch.kernels import activation, attention, cpu, norm, rotary, sampling
from lmdeploy.pytorch.nn.linear import GateUpLinear, Linear
from lmdeploy.pytorch.nn.quant import LinearOptions
from lmdeploy.pytorch.nn.quant.cpu_bf16 import NativeBf16Kernel, OneDnnKernel
from lmdeploy.pytorch.nn.quant.dense import DenseKernel
from lmdeploy.pytorch.nn.quant.int4_cpu import INT4_GROUP, SmallStepInt4Kernel, int4_groups


def scattered_cache(lengths: list[int], num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
    """Random K/V caches and a block table giving each sequence shuffled blocks for its length."""
    widths = [-(-n // block_size) for n in lengths]
    num_blocks = sum(widths) + 3
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(lengths), max(widths), dtype=torch.long)
    for row, width in enumerate(widths):
        table[row, :width] = torch.tensor([order.pop() for _ in range(width)])
    return k_cache, v_cache, table


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('num_heads,num_kv_heads,head_dim',
                         [(9, 3, 64), (4, 4, 32), (16, 2, 128), (6, 1, 64), (2, 2, 64), (4, 2, 128)])
@pytest.mark.parametrize('block_size', [16, 24])
@pytest.mark.parametrize('copies', [1, 6])
def test_paged_decode_attention(native, dtype, num_heads, num_kv_heads, head_dim, block_size, copies):
    """bf16 with head_dim 64/128 takes the AVX-512 path (16-key chunks; up to 4 query heads per pass;
    a task per KV head for a few rows, a task per row for many); q is read in place from a strided view."""
    torch.manual_seed(0)
    lengths = [1, 16, 17, 100, 64, 3, 47] * copies
    k_cache, v_cache, table = scattered_cache(lengths, num_kv_heads, block_size, head_dim, dtype)
    q = torch.randn(len(lengths), num_heads + 2, head_dim).to(dtype)[:, :num_heads]  # heads of a qkv output
    kv_lens = torch.tensor(lengths)
    expected = attention.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, kv_lens, 0.1)
    out = native.paged_decode_attention(q, k_cache, v_cache, table, kv_lens, 0.1)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_int4_groups_reproduce_a_q4_1_grid():
    """Weights on a Q4_1 grid (each group of 32 spans its min and max in 16 steps) come back exactly."""
    torch.manual_seed(0)
    out_features, in_features = 48, 128
    groups = in_features // INT4_GROUP
    scale = (torch.rand(out_features, groups, 1) * 0.02 + 0.001).bfloat16().float()
    low = (torch.randn(out_features, groups, 1) * 0.05).bfloat16().float()
    codes = torch.randint(0, 16, (out_features, groups, INT4_GROUP))
    codes[..., 0], codes[..., 1] = 0, 15
    low = (low + 8 * scale).bfloat16().float() - 8 * scale  # so that the kernel's bf16 zero point is exact
    weight = (codes * scale + low).view(out_features, in_features)
    packed, scales_and_zeros = int4_groups(weight)
    identity = torch.eye(in_features, dtype=torch.bfloat16)
    effective = torch.ops.aten._weight_int4pack_mm_for_cpu(identity, packed, INT4_GROUP, scales_and_zeros)
    torch.testing.assert_close(effective.float().T, weight.bfloat16().float(), atol=0, rtol=0)


def test_small_steps_use_int4_and_big_ones_bf16(monkeypatch):
    """Without the native int4 GEMV (tests/test_int4_gemv.py), small steps run torch's int4 kernel."""
    monkeypatch.setattr(cpu, 'int4_gemv', lambda: None)
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=True).bfloat16()
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    weight = layer.weight.detach().clone()
    layer.finalize(LinearOptions(small_step_int4=True))
    assert isinstance(layer.kernel, SmallStepInt4Kernel) and isinstance(layer.kernel.large, DenseKernel)
    packed, scales_and_zeros = layer.kernel.small.packed, layer.kernel.small.scales_and_zeros
    effective = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(64, dtype=torch.bfloat16), packed, INT4_GROUP,
                                                           scales_and_zeros).float().T
    half_step = scales_and_zeros[..., 0].float().repeat_interleave(INT4_GROUP, 0).T / 2
    assert ((effective - weight.float()).abs() <= half_step * 1.02 + 1e-2).all(), 'round to nearest'
    small, big = torch.randn(2, 64).bfloat16(), torch.randn(9, 64).bfloat16()
    expected = torch.nn.functional.linear(small.float(), effective, layer.bias.float())
    torch.testing.assert_close(layer(small).float(), expected, atol=0.1, rtol=0.02)
    assert torch.equal(layer(big), torch.nn.functional.linear(big, weight, layer.bias))
    fp32 = Linear(64, 32)
    fp32.finalize(LinearOptions(small_step_int4=True))
    assert isinstance(fp32.kernel, DenseKernel), 'fp32 weights keep the exact path'


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('shape', [(5, 64), (3, 4, 32), (1, 576), (2, 40)])
@pytest.mark.parametrize('with_residual', [False, True])
def test_rms_norm(native, dtype, shape, with_residual):
    torch.manual_seed(0)
    x, weight = torch.randn(shape).to(dtype), torch.randn(shape[-1]).to(dtype)
    residual = torch.randn(shape).to(dtype) if with_residual else None
    out, summed = native.rms_norm(x, weight, 1e-6, residual)
    expected, expected_sum = norm.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed, expected_sum)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('shape', [(5, 128), (2, 3, 64), (1, 3072)])
def test_silu_and_mul(native, dtype, shape):
    torch.manual_seed(0)
    gate_up = (torch.randn(shape) * 3).to(dtype)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(native.silu_and_mul(gate_up), activation.silu_and_mul(gate_up), atol=tolerance,
                               rtol=tolerance)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('shape', [(64, 49152), (3, 17), (1, 5), (2, 3, 1000)])
def test_argmax_takes_the_first_of_tied_maxima(native, dtype, shape):
    """Lanes of 16 plus a scalar tail; ties inside one lane, across lanes and in the tail."""
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    for column in (shape[-1] - 1, 3 % shape[-1], 19 % shape[-1], 2 % shape[-1]):
        x[..., column] = 10.0
    assert torch.equal(native.argmax(x), sampling.argmax(x))
    few_values = torch.randint(0, 3, (50, 4099)).to(dtype)
    assert torch.equal(native.argmax(few_values), sampling.argmax(few_values))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('vocab', [320, 49152 + 7])
def test_apply_token_bitmask_matches_xgrammar(native, dtype, vocab):
    """Whole words of 0s and 1s, mixed words and a partial last word; rows left out stay as they were."""
    import xgrammar as xgr
    torch.manual_seed(0)
    x = torch.randn(6, vocab).to(dtype)
    bitmask = xgr.allocate_token_bitmask(6, vocab)
    bitmask.random_(-2**31, 2**31 - 1)
    bitmask[:, ::3] = 0
    bitmask[:, 1::5] = -1
    rows = [0, 2, 3, 5]
    expected = x.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    native.apply_token_bitmask(x, bitmask, rows)
    assert torch.equal(x, expected)
    assert torch.isinf(x[0]).any() and not torch.isinf(x[1]).any()


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('dim', [64, 48])
def test_apply_rotary_on_a_strided_view(native, dtype, dim):
    """The q/k heads of a fused qkv projection: a view whose tokens are further apart than its rows."""
    torch.manual_seed(0)
    tokens, heads, extra = 7, 12, 3
    qkv = torch.randn(tokens, heads + extra, dim).to(dtype)
    x = qkv[:, :heads]
    cos, sin = torch.randn(tokens, dim).to(dtype), torch.randn(tokens, dim).to(dtype)
    out = native.apply_rotary(x, cos, sin)
    expected = rotary.apply_rotary(x, cos, sin)
    assert out.is_contiguous() and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(out, expected), 'the same roundings as the torch version'


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_fill_kv_cache_from_strided_views(native, dtype):
    torch.manual_seed(0)
    tokens, kv_heads, dim, block_size, num_blocks = 11, 3, 64, 4, 8
    qkv = torch.randn(tokens, 9 + 2 * kv_heads, dim).to(dtype)
    k, v = qkv[:, 9:9 + kv_heads], qkv[:, 9 + kv_heads:]
    slots = torch.randperm(num_blocks * block_size)[:tokens]  # distinct (block, offset) pairs
    blocks, offsets = slots // block_size, slots % block_size
    caches = [torch.zeros(num_blocks, kv_heads, block_size, dim, dtype=dtype) for _ in range(4)]
    native.fill_kv_cache(k, v, caches[0], caches[1], blocks, offsets)
    attention.fill_kv_cache(k, v, caches[2], caches[3], blocks, offsets)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


@pytest.mark.parametrize('gemm', ['native', 'onednn'])
@pytest.mark.parametrize('out_features', [1, 37, 48, 80, 176])
def test_packed_bf16_linear_rounds_the_exact_product(monkeypatch, request, gemm, out_features):
    """Packed layers give the fp32 product of the bf16 inputs, rounded once to bf16, for every row count
    (the native GEMM's 6-row tiles up to 64 rows, 4-row ones above, their remainders, and the prefetch
    of the next column group; 48 and 80 columns leave partial panel groups, and 176 on 2 threads takes
    groups of 3 panels, the last one partial; 1 and 37 outputs pad the weight's last panel, whose outputs and bias
    beyond them the native GEMM neither writes nor reads)."""
    if gemm == 'onednn':
        monkeypatch.setattr(cpu, 'bf16_gemm', lambda: None)
    else:
        request.getfixturevalue('native_gemms')  # also on AMX CPUs, where the engine prefers oneDNN
    torch.manual_seed(0)
    layer = Linear(64, out_features, bias=True).bfloat16()
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    weight, bias = layer.weight.detach().float(), layer.bias.float()
    layer.finalize(LinearOptions(pack_cpu=True))
    assert layer.weight is None
    assert isinstance(layer.kernel, NativeBf16Kernel if gemm == 'native' else OneDnnKernel)
    for shape in ((1, 64), (3, 64), (5, 64), (23, 64), (64, 64), (67, 64), (2, 7, 64)):
        x = torch.randn(shape).bfloat16()
        out = layer(x)
        exact = torch.nn.functional.linear(x.float(), weight, bias)
        assert out.dtype == torch.bfloat16 and out.shape == exact.shape
        assert ((out.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    fp32 = Linear(64, 48, bias=True)
    torch.nn.init.normal_(fp32.weight)
    torch.nn.init.normal_(fp32.bias)
    fp32_weight = fp32.weight.detach().clone()
    fp32.finalize(LinearOptions(pack_cpu=True))
    assert isinstance(fp32.kernel, fp32_kernel(DenseKernel)), 'fp32 weights take the fixed-order fp32 GEMM where it is built'
    x = torch.randn(5, 64)
    torch.testing.assert_close(fp32(x), torch.nn.functional.linear(x, fp32_weight, fp32.bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('intermediate_size', [48, 64])
def test_gate_up_silu_in_the_gemm_epilogue(native_gemms, intermediate_size):
    """The fused layer equals the native GEMM followed by the native SiLU-and-mul up to one bf16 step
    of silu(gate) where their exps round differently (which the product then carries), and the torch
    twins up to bf16 rounding (48 leaves a group of two panels)."""
    torch.manual_seed(0)
    layer = GateUpLinear(64, intermediate_size, bias=True).bfloat16()
    torch.nn.init.normal_(layer.weight, std=0.3)
    torch.nn.init.normal_(layer.bias)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    plain = native_gemms.pack_bf16_weight(weight)
    layer.finalize(LinearOptions(pack_cpu=True))
    assert layer.kernel.gate_up and layer.weight is None
    for shape in ((1, 64), (5, 64), (23, 64), (64, 64), (67, 64), (2, 7, 64)):
        x = torch.randn(shape).bfloat16()
        out = layer(x)
        assert out.shape == (*shape[:-1], intermediate_size)
        unfused = native_gemms.silu_and_mul(native_gemms.bf16_linear(x, plain, bias)).float()
        assert ((out.float() - unfused).abs() <= unfused.abs() * 2**-6).all()
        assert (out.float() == unfused).float().mean() > 0.98
        expected = activation.silu_and_mul(torch.nn.functional.linear(x.float(), weight.float(), bias.float()))
        torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.02)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('num_heads,num_kv_heads,head_dim', [(9, 3, 64), (4, 2, 32), (8, 2, 128)])
def test_paged_prefill_attention(native, dtype, num_heads, num_kv_heads, head_dim):
    """Chunks that are their whole context, follow a cached prefix, are one token, or span many blocks."""
    torch.manual_seed(0)
    block_size, chunks = 24, [(5, 5), (20, 45), (1, 17), (70, 70), (3, 100), (40, 150)]  # (q_len, ctx_len)
    q_lens, ctx_lens = [n for n, _ in chunks], [c for _, c in chunks]
    k_cache, v_cache, table = scattered_cache(ctx_lens, num_kv_heads, block_size, head_dim, dtype)
    q_start = torch.tensor([sum(q_lens[:i]) for i in range(len(chunks))])
    k = torch.empty(sum(q_lens), num_kv_heads, head_dim)
    v = torch.empty_like(k)
    for row, (start, n, c) in enumerate(zip(q_start.tolist(), q_lens, ctx_lens)):
        blocks = table[row, :-(-c // block_size)]
        k[start:start + n] = attention._gather_context(k_cache.float()[blocks], c)[:, c - n:].transpose(0, 1)
        v[start:start + n] = attention._gather_context(v_cache.float()[blocks], c)[:, c - n:].transpose(0, 1)
    q = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype)
    args = (table, q_start, torch.tensor(q_lens), torch.tensor(ctx_lens), max(q_lens), 0.3)
    out = native.paged_prefill_attention(q, k.to(dtype), v.to(dtype), k_cache, v_cache, *args)
    expected = attention.prefill_attention(q.float(), k, v, k_cache.float(), v_cache.float(), *args)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
