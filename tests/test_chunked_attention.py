"""Chunked attention (``attention_chunk`` C, Llama 4's rope layers: a query at position p attends only to keys in
``[floor(p / C) * C, p]``): the torch twin against a dense float64 reference with transformers' chunked mask, the
native CPU kernels (generic, AVX-512 and AVX512-BF16 GEMM paths, plain and quantized caches) and the Triton
kernels (interpreter on the CPU) against the twin, prefill and decode, at contexts spanning several chunks. The
blocks a chunked layer's sliding pool gives back (those wholly before p - C + 1 for the next position p) change
nothing: the native kernels never read them (NaN there), the twin masks them."""
from __future__ import annotations

import math

import pytest
import torch
from test_attention_features import BLOCK, as_float, case

from lmdeploy.pytorch.kernels import attention
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.paging.block_pool import BlockPool

CONTEXTS, CHUNKS = [23, 40, 9, 70], [23, 11, 1, 30]
# chunks narrower than a cache block (8 slots), equal to it, across blocks, and one longer than every context
ATTENTION_CHUNKS = [3, 8, 12, 100]


def dense_chunked(q, k, v, scale, chunk):
    """``q [L, H, D]``: the last L of the C positions of ``k, v [C, H_kv, D]``; causal and within the query's
    chunk as transformers masks it (``kv_idx // chunk == q_idx // chunk``), in float64."""
    length, num_heads, _ = q.shape
    context = k.shape[0]
    group = num_heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum('lhd,chd->hlc', q.double(), k) * scale
    q_idx = torch.arange(context - length, context)[:, None]
    kv_idx = torch.arange(context)[None]
    allowed = (kv_idx <= q_idx) & (kv_idx // chunk == q_idx // chunk)
    return torch.einsum('hlc,chd->lhd', scores.masked_fill(~allowed, -math.inf).softmax(-1), v)


def junk_block_like(cache: torch.Tensor, poison: bool) -> torch.Tensor:
    """One block of junk shaped as a block of ``cache``: random codes, NaN values and scales where ``poison``, else
    large finite ones."""
    g = torch.Generator().manual_seed(5)
    if cache.dtype == torch.uint8:
        return torch.randint(0, 256, cache[:1].shape, generator=g, dtype=torch.uint8).to(cache.device)
    if poison:
        return torch.full_like(cache[:1], float('nan'))
    return (torch.randn(cache[:1].shape, generator=g) * 50).to(cache.device, cache.dtype)


def give_back(caches: tuple[torch.Tensor, ...], table: torch.Tensor, next_positions: list[int], chunk: int,
              block_size: int, poison: bool = True) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, int]:
    """``caches`` with a junk block appended (:func:`junk_block_like`), and ``table`` whose entries a sliding pool
    of window ``chunk`` gives back before each sequence computes ``next_positions[s]``
    (``BlockPool.first_kept_block``) read it; with the number of entries given back."""
    caches = tuple(torch.cat([c, junk_block_like(c, poison)]) for c in caches)
    junk = caches[0].shape[0] - 1
    table, pool, count = table.clone(), BlockPool(1, window=chunk), 0
    for row, position in enumerate(next_positions):
        first = pool.first_kept_block(position, block_size)
        table[row, :first] = junk
        count += first
    return caches, table, count


@pytest.mark.parametrize('quant_policy', [0, 8])
@pytest.mark.parametrize('chunk', ATTENTION_CHUNKS)
def test_twin_matches_the_dense_reference(chunk, quant_policy):
    """Whole prompts, chunks over a cached prefix and decode, with GQA; a quantized cache against the values it
    holds."""
    args, ks, vs = case(CONTEXTS, CHUNKS, 6, 2, 16, torch.float32, quant_policy)
    out = attention.prefill_attention(*args, attention_chunk=chunk)
    q, starts = args[0], args[6].tolist()
    for s, n in enumerate(CHUNKS):
        expected = dense_chunked(q[starts[s]:starts[s] + n], ks[s], vs[s], 0.3, chunk)
        torch.testing.assert_close(out[starts[s]:starts[s] + n].double(), expected, atol=2e-5, rtol=2e-5)
    last = torch.stack([q[starts[s] + n - 1] for s, n in enumerate(CHUNKS)])
    out = attention.decode_attention(last, *args[3:6], torch.tensor(CONTEXTS), 0.3, *args[11:], attention_chunk=chunk)
    for s in range(len(CONTEXTS)):
        expected = dense_chunked(last[s:s + 1], ks[s], vs[s], 0.3, chunk)[0]
        torch.testing.assert_close(out[s].double(), expected, atol=2e-5, rtol=2e-5)
    if chunk < max(CONTEXTS):  # the chunk changes what the long sequences see
        full = attention.decode_attention(last, *args[3:6], torch.tensor(CONTEXTS), 0.3, *args[11:])
        assert (full[3] - out[3]).abs().max() > 1e-2


@pytest.mark.parametrize('dtype,head_dim', [(torch.float32, 32), (torch.bfloat16, 32), (torch.bfloat16, 64),
                                            (torch.bfloat16, 128)])
@pytest.mark.parametrize('quant_policy', [0, 8, 4])
@pytest.mark.parametrize('chunk', ATTENTION_CHUNKS[:3])
def test_native_matches_the_twin(native, dtype, head_dim, quant_policy, chunk):
    """fp32 takes the generic path; bf16 with head_dim 32 the AVX-512 rows, 64 and 128 the AVX512-BF16 GEMM path
    in prefill (where the CPU has it); bf16 outputs average as few as one to three values (bf16 probabilities)."""
    args, _, _ = case(CONTEXTS, CHUNKS, 8, 2, head_dim, dtype, quant_policy, seed=3)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    expected = attention.prefill_attention(*as_float(args), attention_chunk=chunk)
    torch.testing.assert_close(native.paged_prefill_attention(*args, attention_chunk=chunk).float(), expected,
                               atol=tol, rtol=tol)
    q = torch.randn(len(CONTEXTS), 8, head_dim).to(dtype)
    decode = (q, *args[3:6], torch.tensor(CONTEXTS), 0.3, *args[11:])
    torch.testing.assert_close(native.paged_decode_attention(*decode, attention_chunk=chunk).float(),
                               attention.decode_attention(*as_float(decode), attention_chunk=chunk), atol=tol, rtol=tol)


def test_native_rejects_a_window_with_a_chunk(native):
    args, _, _ = case(CONTEXTS, CHUNKS, 8, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match='not both'):
        native.paged_prefill_attention(*args, sliding_window=4, attention_chunk=8)


def test_a_layer_with_a_window_and_a_chunk_is_refused():
    with pytest.raises(ValueError, match='not both'):
        PagedAttention(4, 2, 16, 0.25, sliding_window=4, attention_chunk=8)


@pytest.mark.parametrize('quant_policy', [0, 8, 4])
@pytest.mark.parametrize('chunk', ATTENTION_CHUNKS[:3])
@pytest.mark.parametrize('kernels,dtype,head_dim', [('twin', torch.float32, 16), ('native', torch.float32, 32),
                                                    ('native', torch.bfloat16, 32), ('native', torch.bfloat16, 64),
                                                    ('native', torch.bfloat16, 128)])
def test_given_back_blocks_change_nothing(kernels, dtype, head_dim, chunk, quant_policy, request):
    """Prefill chunks and decode over tables whose given-back entries read a junk block: the same outputs, to the
    bit. The native generic, AVX-512 and AVX512-BF16 GEMM paths never read it (NaN there); the torch twin reads it
    and masks it (finite junk: given-back entries read block 0, a live block)."""
    kernel_set = attention if kernels == 'twin' else request.getfixturevalue('native')
    prefill = attention.prefill_attention if kernels == 'twin' else kernel_set.paged_prefill_attention
    decode = attention.decode_attention if kernels == 'twin' else kernel_set.paged_decode_attention
    args, _, _ = case(CONTEXTS, CHUNKS, 8, 2, head_dim, dtype, quant_policy, seed=4)
    num_caches = 2 + (2 if quant_policy else 0)
    caches = (*args[3:5], *args[11:11 + num_caches - 2])
    first_rows = [context - n for context, n in zip(CONTEXTS, CHUNKS)]
    poison = kernels == 'native'
    (k_cache, v_cache, *scales), table, count = give_back(caches, args[5], first_rows, chunk, BLOCK, poison)
    assert count > 0
    junk_args = (*args[:3], k_cache, v_cache, table, *args[6:11], *scales, *args[11 + len(scales):])
    assert torch.equal(prefill(*junk_args, attention_chunk=chunk), prefill(*args, attention_chunk=chunk))
    q = torch.randn(len(CONTEXTS), 8, head_dim, generator=torch.Generator().manual_seed(6)).to(dtype)
    quant = args[11:]
    (k_cache, v_cache, *scales), table, count = give_back(caches, args[5], [c - 1 for c in CONTEXTS], chunk, BLOCK,
                                                          poison)
    assert count > 0
    lengths = torch.tensor(CONTEXTS)
    expected = decode(q, *args[3:6], lengths, 0.3, *quant, attention_chunk=chunk)
    out = decode(q, k_cache, v_cache, table, lengths, 0.3, *scales, *quant[len(scales):], attention_chunk=chunk)
    assert torch.equal(out, expected)
