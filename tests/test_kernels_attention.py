"""Triton paged decode and varlen prefill attention against their torch twins (interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch
from helpers import scattered_block_table
from kernel_env import DEVICE, DTYPES

from lmdeploy.pytorch.kernels import attention
from lmdeploy.pytorch.kernels import cuda as triton_kernels
from lmdeploy.pytorch.kernels.cuda.decode_attention import (MAX_SPLITS, DecodeConfig, decode_attention_with,
                                                            decode_config, grid_splits)
from lmdeploy.pytorch.kernels.kv_quant import quantize_kv

pytestmark = pytest.mark.triton
TOL = {torch.float32: 2e-3 if DEVICE == 'cuda' else 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
BLOCK_SIZE = 16


def paged_cache(lengths: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0,
                block_size: int = BLOCK_SIZE):
    """Random K/V caches and a block table giving each sequence scattered blocks for ``lengths`` tokens."""
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = scattered_block_table(lengths, block_size, g)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(2))
    return k_cache, v_cache, table.to(DEVICE)


def rand(*shape, dtype, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def assert_close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def paged_case(lengths: list[int], num_heads: int, num_kv_heads: int, dtype: torch.dtype, width: int = 0):
    """``(q, k_cache, v_cache, block_table, kv_lens)``; ``width`` pads the table (graph capture's wide tables)."""
    k_cache, v_cache, table = paged_cache(lengths, num_kv_heads, 32, dtype)
    if width > table.shape[1]:
        table = torch.cat([table, table.new_zeros(len(lengths), width - table.shape[1])], dim=1)
    q = rand(len(lengths), num_heads, 32, dtype=dtype)
    return q, k_cache, v_cache, table, torch.tensor(lengths, device=DEVICE)


def decode_reference(q, k_cache, v_cache, table, kv_lens):
    return attention.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, kv_lens, 0.2)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('lengths,num_heads,num_kv_heads,width', [
    ([1, 37, 16, 90], 6, 2, 0),  # ragged, GQA group of 3, partial last blocks
    ([40, 7], 4, 1, 64),  # short sequences in a 64-page table: most programs past their sequence's splits
])
def test_decode_attention(dtype, lengths, num_heads, num_kv_heads, width):
    case = paged_case(lengths, num_heads, num_kv_heads, dtype, width)
    out = triton_kernels.decode_attention(*case, 0.2)
    assert_close(out, decode_reference(*case), dtype)


@pytest.mark.parametrize('dtype', DTYPES[-1:])  # launch shapes; the dtypes go through the default config above
@pytest.mark.parametrize('lengths,width,config', [
    ([1100, 17, 250], 0, DecodeConfig(3, 2, 4, 2)),  # 69 pages in 23 splits: 3 per split, half-used steps
    ([1, 300, 64, 129], 40, DecodeConfig(1, 1, 4, 3)),  # mixed lengths, a page per split, page-aligned and not
    ([200, 33], 13, DecodeConfig(5, 4, 4, 1)),  # 4 pages per step past a split's end
    ([2100, 40], 0, DecodeConfig(1, 1, 4, 3)),  # 132 pages: past MAX_SPLITS splits, 2 pages per split
])
def test_decode_attention_configs(dtype, lengths, width, config):
    case = paged_case(lengths, 4, 2, dtype, width)
    out = decode_attention_with(*case, 0.2, config)
    assert_close(out, decode_reference(*case), dtype)


@pytest.mark.parametrize('with_sinks', [False, True])
def test_decode_empty_sequence_gives_zeros(with_sinks):
    """A padded row of a captured batch (``kv_len`` 0: no splits) yields zeros, with sinks too, and its neighbours
    stay exact."""
    q, k_cache, v_cache, table, kv_lens = paged_case([50, 0, 20], 4, 2, torch.float32, 8)
    sinks = features(None, None, with_sinks, 4)['sinks']
    out = decode_attention_with(q, k_cache, v_cache, table, kv_lens, 0.2, DecodeConfig(1, 2, 4, 2), sinks=sinks)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = torch.tensor([0, 2], device=DEVICE)
    ref = attention.decode_attention(q[keep], k_cache, v_cache, table[keep], kv_lens[keep], 0.2, sinks=sinks)
    assert_close(out[keep], ref, torch.float32)


def test_split_policy_depends_on_shapes_only():
    """256 tokens a split: a 32k context in 64-token pages takes 128 splits (8 programs per SM at 8 KV heads);
    the grid covers the widest table's sequence, at most MAX_SPLITS, and a window's pages only."""
    assert decode_config(64) == DecodeConfig(4, 1, 4, 3) and decode_config(16).split_pages == 16
    assert decode_config(512).split_pages == 1  # pages larger than a split
    assert decode_config(64, 256) == DecodeConfig(4, 1, 8, 3)  # head dim 256: 8 warps (4 spilled at sm_90)
    assert grid_splits(512, 64, 4) == 128 and grid_splits(3, 64, 4) == 1
    assert grid_splits(2048, 64, 4) == MAX_SPLITS  # a 128k table: longer splits past 32k tokens
    assert grid_splits(512, 64, 4, 1024, 1) == 5  # a 1024-token window spans at most 17 pages


def prefill_case(chunks: list[tuple[int, int]], dtype: torch.dtype, num_heads: int = 4, head_dim: int = 24,
                 block_size: int = BLOCK_SIZE):
    """``(q, k, v, k_cache, v_cache, table, q_start, q_len, ctx_len, max_q_len)`` for chunks ``(q_len, ctx_len)``;
    the fresh ``k, v`` are the chunks' rows of the caches."""
    num_kv_heads = 2
    ctx_lens = [c for _, c in chunks]
    k_cache, v_cache, table = paged_cache(ctx_lens, num_kv_heads, head_dim, dtype, seed=2, block_size=block_size)
    q_lens = [n for n, _ in chunks]
    q_start = [sum(q_lens[:i]) for i in range(len(q_lens))]
    k = torch.empty(sum(q_lens), num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.empty_like(k)
    for row, (start, n, c) in enumerate(zip(q_start, q_lens, ctx_lens)):
        blocks = table[row, :-(-c // block_size)]
        k[start:start + n] = attention._gather_context(k_cache[blocks], c)[:, c - n:].transpose(0, 1)
        v[start:start + n] = attention._gather_context(v_cache[blocks], c)[:, c - n:].transpose(0, 1)
    q = rand(sum(q_lens), num_heads, head_dim, dtype=dtype, seed=3)
    args = [torch.tensor(x, device=DEVICE) for x in (q_start, q_lens, ctx_lens)]
    return q, k, v, k_cache, v_cache, table, *args, max(q_lens)


def as_float(args) -> list:
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('chunks', [
    [(5, 5), (20, 45), (1, 17), (16, 32)],  # (q_len, ctx_len): fresh, unaligned prefix, one token, aligned prefix
    [(70, 70), (3, 100)],  # a chunk longer than BLOCK_M
])
def test_prefill_attention(dtype, chunks):
    case = prefill_case(chunks, dtype)
    out = triton_kernels.prefill_attention(*case, 0.3)
    assert_close(out, attention.prefill_attention(*as_float(case), 0.3), dtype)


# (sliding_window, logit_softcap, with sinks); windows narrower than a page, a BLOCK_M and the contexts
FEATURES = [(5, None, False), (40, None, False), (None, 2.5, False), (None, None, True), (20, 3.0, True)]
# The features act on the fp32 scores; in the interpreter a dtype changes only the loads' and stores' casts, which
# the plain tests above check in every dtype, so on the CPU the features run in fp32 (its tolerance is the tightest).
FEATURE_DTYPES = DTYPES if DEVICE == 'cuda' else DTYPES[:1]


def features(window, softcap, with_sinks, num_heads) -> dict:
    sinks = rand(num_heads, dtype=torch.float32, seed=9) * 2 if with_sinks else None
    return dict(sliding_window=window, logit_softcap=softcap, sinks=sinks)


@pytest.mark.parametrize('dtype', FEATURE_DTYPES)
@pytest.mark.parametrize('window,softcap,with_sinks', FEATURES)
def test_decode_attention_features(dtype, window, softcap, with_sinks):
    """The default launch and one with several pages per step and split (the window starts mid-split)."""
    case = paged_case([1, 37, 16, 90, 300], 6, 2, dtype, 24)
    f = features(window, softcap, with_sinks, 6)
    ref = attention.decode_attention(*as_float(case), 0.2, **f)
    assert_close(triton_kernels.decode_attention(*case, 0.2, **f), ref, dtype)
    assert_close(decode_attention_with(*case, 0.2, DecodeConfig(3, 2, 4, 1), **f), ref, dtype)


@pytest.mark.parametrize('bits', [0, 8])
@pytest.mark.parametrize('dtype', FEATURE_DTYPES)
@pytest.mark.parametrize('window,softcap,with_sinks', FEATURES)
def test_prefill_attention_features(dtype, window, softcap, with_sinks, bits):
    """Chunks over cached prefixes and whole prompts, plain and int8 caches."""
    q, k, v, k_cache, v_cache, table, *rest = prefill_case([(5, 5), (20, 45), (1, 17), (70, 70), (3, 100)], dtype)
    quant = quantize_case(k_cache, v_cache, bits) if bits else (k_cache, v_cache)
    case = (q, k, v, *quant[:2], table, *rest, 0.3, *quant[2:], *((bits,) if bits else ()))
    f = features(window, softcap, with_sinks, 4)
    assert_close(triton_kernels.prefill_attention(*case, **f), attention.prefill_attention(*as_float(case), **f),
                 dtype)


@pytest.mark.parametrize('bits', [0, 8])
@pytest.mark.parametrize('window', [None, 40])
def test_prefill_attention_reads_pages_in_steps(window, bits):
    """Pages of 128 keys, read 64 at a time (the kernel's step; Gemma's 256-wide heads take 32 of a 64-key page):
    prefixes ending mid-page and mid-step, a window starting in a page's second step."""
    dtype = DTYPES[-1]
    q, k, v, k_cache, v_cache, table, *rest = prefill_case([(20, 150), (70, 70), (3, 200)], dtype, block_size=128)
    quant = quantize_case(k_cache, v_cache, bits) if bits else (k_cache, v_cache)
    case = (q, k, v, *quant[:2], table, *rest, 0.3, *quant[2:], *((bits,) if bits else ()))
    assert_close(triton_kernels.prefill_attention(*case, sliding_window=window),
                 attention.prefill_attention(*as_float(case), sliding_window=window), dtype)


def quantize_case(k_cache, v_cache, bits):
    """``(k_codes, v_codes, k_sz, v_sz)`` of float caches, as the torch twin's fill writes them."""
    (k, k_sz), (v, v_sz) = quantize_kv(k_cache, bits), quantize_kv(v_cache, bits)
    return k, v, k_sz, v_sz


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', DTYPES)
def test_decode_attention_quantized(dtype, bits):
    """int8/int4 caches, dequantized as they are loaded, against the twin (which dequantizes the blocks)."""
    q, k_cache, v_cache, table, kv_lens = paged_case([1, 37, 16, 90], 6, 2, dtype, 8)
    k, v, k_sz, v_sz = quantize_case(k_cache, v_cache, bits)
    out = triton_kernels.decode_attention(q, k, v, table, kv_lens, 0.2, k_sz, v_sz, bits)
    ref = attention.decode_attention(q.float(), k, v, table, kv_lens, 0.2, k_sz, v_sz, bits)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', DTYPES)
def test_prefill_attention_quantized(dtype, bits):
    """With a quantized cache the chunk's own K/V are read back from the cache (the fresh ones are not used)."""
    chunks = [(5, 5), (20, 45), (1, 17), (70, 70), (3, 100)]  # (q_len, ctx_len)
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    ctx_lens, q_lens = [c for _, c in chunks], [n for n, _ in chunks]
    k_cache, v_cache, table = paged_cache(ctx_lens, num_kv_heads, head_dim, dtype, seed=2)
    k, v, k_sz, v_sz = quantize_case(k_cache, v_cache, bits)
    q = rand(sum(q_lens), num_heads, head_dim, dtype=dtype, seed=3)
    fresh = torch.full((sum(q_lens), num_kv_heads, head_dim), float('nan'), dtype=dtype, device=DEVICE)
    args = [torch.tensor(x, device=DEVICE) for x in ([sum(q_lens[:i]) for i in range(len(q_lens))], q_lens, ctx_lens)]
    out = triton_kernels.prefill_attention(q, fresh, fresh, k, v, table, *args, max(q_lens), 0.3, k_sz, v_sz, bits)
    ref = attention.prefill_attention(q.float(), fresh.float(), fresh.float(), k, v, table, *args, max(q_lens), 0.3,
                                      k_sz, v_sz, bits)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize('bits', [0, 8])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('window', [None, 5])
def test_prefill_attention_key_limit(dtype, window, bits):
    """Image spans whose tokens attend to each other (Gemma 3): spans inside a whole prompt, one crossing a
    BLOCK_M boundary (its earlier program reads past its own rows), one in a chunk over a cached prefix."""
    chunks = [(40, 40), (70, 70), (12, 45)]  # (q_len, ctx_len)
    spans = [[(3, 9), (20, 31)], [(10, 20), (60, 68)], [(35, 41)]]
    q, k, v, k_cache, v_cache, table, *rest = prefill_case(chunks, dtype)
    limits = []
    for (n, c), seq_spans in zip(chunks, spans):
        positions = list(range(c - n, c))
        limits += [next((e - 1 for s, e in seq_spans if s <= p < e), p) for p in positions]
    quant = quantize_case(k_cache, v_cache, bits) if bits else (k_cache, v_cache)
    case = (q, k, v, *quant[:2], table, *rest, 0.3, *quant[2:], *((bits,) if bits else ()))
    f = dict(sliding_window=window, key_limit=torch.tensor(limits, device=DEVICE))
    ref = attention.prefill_attention(*as_float(case), **f)
    assert_close(triton_kernels.prefill_attention(*case, **f), ref, dtype)
    assert (ref - attention.prefill_attention(*as_float(case), sliding_window=window)).abs().max() > 0.1
