"""Sliding window, logit soft-capping and attention sinks: the torch twin against a dense float64
reference with transformers' masking, and the native CPU kernels against the twin (plain and
quantized caches)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import scattered_block_table

from lmdeploy.pytorch.kernels import attention
from lmdeploy.pytorch.kernels.kv_quant import dequantize_kv

BLOCK = 8
FEATURES = [  # (sliding_window, logit_softcap, with sinks)
    (None, None, False), (1, None, False), (5, None, False), (16, None, False), (None, 2.5, False),
    (None, None, True), (7, 3.0, True),
]


def dense_reference(q, k, v, scale, window, softcap, sinks):
    """``q [L, H, D]``: the last L of the C positions of ``k, v [C, H_kv, D]``; causal, the window as
    transformers masks it (``kv_idx > q_idx - window``), in float64."""
    length, num_heads, _ = q.shape
    context = k.shape[0]
    group = num_heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum('lhd,chd->hlc', q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_idx = torch.arange(context - length, context)[:, None]
    kv_idx = torch.arange(context)[None]
    allowed = kv_idx <= q_idx
    if window:
        allowed &= kv_idx > q_idx - window
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(num_heads, length, 1)], -1)
    probs = scores.softmax(-1)[..., :context]
    return torch.einsum('hlc,chd->lhd', probs, v)


def paged(contexts: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, quant_policy: int, seed: int):
    """Each sequence's K/V ``[C, H_kv, D]`` written to shuffled blocks of a cache (quantized with
    ``quant_policy``): ``(ks, vs, cache_args, table)``, ``ks, vs`` as the cache holds them."""
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = scattered_block_table(contexts, BLOCK, g)
    if quant_policy:
        codes = (num_blocks, num_kv_heads, BLOCK, head_dim * quant_policy // 8)
        cache = [torch.zeros(codes, dtype=torch.uint8), torch.zeros(codes, dtype=torch.uint8),
                 torch.zeros(num_blocks, num_kv_heads, BLOCK, 2), torch.zeros(num_blocks, num_kv_heads, BLOCK, 2)]
    else:
        cache = [torch.zeros(num_blocks, num_kv_heads, BLOCK, head_dim, dtype=dtype) for _ in range(2)]
    ks, vs = [], []
    for row, context in enumerate(contexts):
        k = torch.randn(context, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(context, num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(context)
        attention.fill_kv_cache(k, v, cache[0], cache[1], table[row][pos // BLOCK], pos % BLOCK, *cache[2:],
                                *((quant_policy,) if quant_policy else ()))
        if quant_policy:  # what the cache holds
            blocks = table[row][pos // BLOCK]
            k = dequantize_kv(cache[0][blocks, :, pos % BLOCK], cache[2][blocks, :, pos % BLOCK], quant_policy, dtype)
            v = dequantize_kv(cache[1][blocks, :, pos % BLOCK], cache[3][blocks, :, pos % BLOCK], quant_policy, dtype)
        ks.append(k)
        vs.append(v)
    quant = (*cache[2:], quant_policy) if quant_policy else ()
    return ks, vs, (cache[0], cache[1]), quant, table


def case(contexts, chunks, num_heads, num_kv_heads, head_dim, dtype, quant_policy=0, seed=0):
    """A prefill case: sequence s has ``contexts[s]`` tokens cached, its last ``chunks[s]`` the chunk."""
    ks, vs, caches, quant, table = paged(contexts, num_kv_heads, head_dim, dtype, quant_policy, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(chunks), num_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + chunks[:-1]).cumsum(0)
    k = torch.cat([k[-n:] for k, n in zip(ks, chunks)])
    v = torch.cat([v[-n:] for v, n in zip(vs, chunks)])
    args = (q, k, v, *caches, table, starts, torch.tensor(chunks), torch.tensor(contexts), max(chunks), 0.3, *quant)
    return args, ks, vs


def as_float(args: tuple) -> tuple:
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def features(window, softcap, with_sinks, num_heads):
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(7)) * 2 if with_sinks else None
    return dict(sliding_window=window, logit_softcap=softcap, sinks=sinks)


@pytest.mark.parametrize('quant_policy', [0, 8, 4])
@pytest.mark.parametrize('window,softcap,with_sinks', FEATURES)
def test_twin_matches_the_dense_reference(window, softcap, with_sinks, quant_policy):
    """Whole prompts, chunks over a cached prefix, and decode, with GQA; quantized caches against the
    values they hold."""
    contexts, chunks = [23, 40, 9], [23, 11, 1]
    (args, ks, vs), f = case(contexts, chunks, 6, 2, 16, torch.float32, quant_policy), features(
        window, softcap, with_sinks, 6)
    out = attention.prefill_attention(*args, **f)
    q, starts = args[0], args[6].tolist()
    for s, n in enumerate(chunks):
        expected = dense_reference(q[starts[s]:starts[s] + n], ks[s], vs[s], 0.3, window, softcap, f['sinks'])
        torch.testing.assert_close(out[starts[s]:starts[s] + n].double(), expected, atol=2e-5, rtol=2e-5)
    last = torch.stack([q[starts[s] + n - 1] for s, n in enumerate(chunks)])
    out = attention.decode_attention(last, *args[3:6], torch.tensor(contexts), 0.3, *args[11:], **f)
    for s in range(len(contexts)):
        expected = dense_reference(last[s:s + 1], ks[s], vs[s], 0.3, window, softcap, f['sinks'])[0]
        torch.testing.assert_close(out[s].double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('quant_policy', [0, 8, 4])
@pytest.mark.parametrize('window,softcap,with_sinks', FEATURES)
@pytest.mark.parametrize('head_dim', [32, 64])
def test_native_matches_the_twin(native, dtype, quant_policy, window, softcap, with_sinks, head_dim):
    """Decode and prefill against the twin in fp32; bf16 with head_dim 64 and no feature takes the
    AVX-512 paths."""
    contexts, chunks = [23, 40, 9, 70], [23, 11, 1, 30]
    args, _, _ = case(contexts, chunks, 8, 2, head_dim, dtype, quant_policy, seed=3)
    f = features(window, softcap, with_sinks, 8)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    expected = attention.prefill_attention(*as_float(args), **f)
    torch.testing.assert_close(native.paged_prefill_attention(*args, **f).float(), expected.float(), atol=tol,
                               rtol=tol)
    q = torch.randn(len(contexts), 8, head_dim).to(dtype)
    decode = (q, *args[3:6], torch.tensor(contexts), 0.3, *args[11:])
    torch.testing.assert_close(native.paged_decode_attention(*decode, **f).float(),
                               attention.decode_attention(*as_float(decode), **f), atol=tol, rtol=tol)
