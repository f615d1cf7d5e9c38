"""Triton RMSNorm, rotary, SiLU-and-mul and fill-KV-cache against their torch twins (interpreter on CPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_env import DEVICE, DTYPES

from lmdeploy.pytorch import kernels
from lmdeploy.pytorch.kernels import activation, attention, norm, rotary
from lmdeploy.pytorch.kernels import cuda as triton_kernels

pytestmark = pytest.mark.triton
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rand(*shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(DEVICE, dtype)


def assert_close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('with_residual', [False, True])
def test_rms_norm(dtype, with_residual):
    x, w = rand(5, 3, 40, dtype=dtype), rand(40, dtype=dtype)
    res = rand(5, 3, 40, dtype=dtype) + 1 if with_residual else None
    out, summed = triton_kernels.rms_norm(x[:, 1:], w, 1e-6, None if res is None else res[:, 1:])
    ref_out, ref_sum = norm.rms_norm(x[:, 1:].float(), w.float(), 1e-6, None if res is None else res[:, 1:].float())
    assert_close(out, ref_out, dtype)
    assert_close(summed, ref_sum, dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_rotary_on_a_strided_view(dtype):
    qkv = rand(7, 6, 24, dtype=dtype)
    pos = torch.arange(7, device=DEVICE).float()[:, None] * torch.linspace(0.1, 1, 12, device=DEVICE)
    cos, sin = torch.cat((pos, pos), -1).cos().to(dtype), torch.cat((pos, pos), -1).sin().to(dtype)
    out = triton_kernels.apply_rotary(qkv[:, :5], cos, sin)
    assert_close(out, rotary.apply_rotary(qkv[:, :5].float(), cos.float(), sin.float()), dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_silu_and_mul(dtype):
    x = rand(2, 9, 2 * 48, dtype=dtype)
    out = triton_kernels.silu_and_mul(x)
    assert out.shape == (2, 9, 48)
    assert_close(out, activation.silu_and_mul(x.float()), dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_fill_kv_cache(dtype):
    kv = rand(6, 2 * 3, 20, dtype=dtype)
    k, v = kv[:, :3], kv[:, 3:]
    blocks = torch.tensor([4, 4, 1, 0, 0, 2], device=DEVICE)
    offsets = torch.tensor([0, 3, 7, 1, 2, 5], device=DEVICE)
    caches = [torch.zeros(5, 3, 8, 20, dtype=dtype, device=DEVICE) for _ in range(4)]
    triton_kernels.fill_kv_cache(k, v, caches[0], caches[1], blocks, offsets)
    attention.fill_kv_cache(k, v, caches[2], caches[3], blocks, offsets)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', DTYPES)
def test_fill_kv_cache_quantized(dtype, bits):
    """int8/int4 codes and (scale, zero) per row, as the torch twin writes them (head_dim 20: masked lanes)."""
    kv = rand(6, 2 * 3, 20, dtype=dtype)
    k, v = kv[:, :3], kv[:, 3:]
    blocks = torch.tensor([4, 4, 1, 0, 0, 2], device=DEVICE)
    offsets = torch.tensor([0, 3, 7, 1, 2, 5], device=DEVICE)
    caches = [[torch.zeros(5, 3, 8, 20 * bits // 8, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
              + [torch.zeros(5, 3, 8, 2, device=DEVICE) for _ in range(2)] for _ in range(2)]
    triton_kernels.fill_kv_cache(k, v, *caches[0][:2], blocks, offsets, *caches[0][2:], bits)
    attention.fill_kv_cache(k, v, *caches[1][:2], blocks, offsets, *caches[1][2:], bits)
    for mine, ref in zip(caches[0], caches[1]):
        if mine.dtype == torch.uint8:  # a code may be off by one where the GPU fuses a multiply-add
            unpack = (lambda c: torch.cat((c & 15, c >> 4), -1)) if bits == 4 else (lambda c: c)
            assert (unpack(mine).int() - unpack(ref).int()).abs().max() <= 1
        else:
            torch.testing.assert_close(mine, ref, atol=0, rtol=1e-6)


def test_dispatch_on_cpu_picks_the_native_kernel_else_the_torch_twin(monkeypatch):
    x = torch.randn(3, 8)
    monkeypatch.setattr(kernels.cpu, 'native', lambda: None)
    assert torch.equal(kernels.silu_and_mul(x), activation.silu_and_mul(x))
    calls = []
    monkeypatch.setattr(kernels.cpu, 'native', lambda: SimpleNamespace(silu_and_mul=lambda t: calls.append(t) or t))
    assert kernels.silu_and_mul(x) is x and calls == [x]
    assert kernels.rms_norm.__doc__ == norm.rms_norm.__doc__


@pytest.mark.skipif(DEVICE != 'cuda', reason='needs CUDA')
def test_dispatch_picks_triton_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_kernels, 'silu_and_mul', lambda x: calls.append(x) or x)
    kernels.silu_and_mul(torch.randn(3, 8, device='cuda'))
    assert len(calls) == 1
