"""Triton paged decode and prefill attention with an attention chunk (Llama 4) against the torch twin (interpreter
on the CPU): chunks narrower than a page, across pages and a BLOCK_M, over cached prefixes and whole prompts; the
pages a chunked layer's sliding pool gives back are never read (NaN there changes nothing)."""
from __future__ import annotations

import functools

import pytest
import torch
from test_chunked_attention import give_back
from test_kernels_attention import (BLOCK_SIZE, FEATURE_DTYPES, as_float, assert_close, paged_case, prefill_case,
                                    quantize_case)

from lmdeploy.pytorch.kernels import attention
from lmdeploy.pytorch.kernels import cuda as triton_kernels
from lmdeploy.pytorch.kernels.cuda.decode_attention import DecodeConfig, decode_attention_with

pytestmark = pytest.mark.triton
ATTENTION_CHUNKS = [8, 24, 70]


@pytest.mark.parametrize('dtype', FEATURE_DTYPES)  # see test_kernels_attention.py
@pytest.mark.parametrize('chunk', ATTENTION_CHUNKS)
def test_decode_attention_chunk(dtype, chunk):
    """The default launch and one with several pages per step and split (the chunk starts mid-split)."""
    case = paged_case([1, 37, 16, 90, 300], 6, 2, dtype, 24)
    ref = attention.decode_attention(*as_float(case), 0.2, attention_chunk=chunk)
    assert_close(triton_kernels.decode_attention(*case, 0.2, attention_chunk=chunk), ref, dtype)
    assert_close(decode_attention_with(*case, 0.2, DecodeConfig(3, 2, 4, 1), attention_chunk=chunk), ref, dtype)
    assert (ref - attention.decode_attention(*as_float(case), 0.2)).abs().max() > 1e-2


@pytest.mark.parametrize('bits', [0, 8])
@pytest.mark.parametrize('dtype', FEATURE_DTYPES)  # see test_kernels_attention.py
@pytest.mark.parametrize('chunk', ATTENTION_CHUNKS)
def test_prefill_attention_chunk(dtype, chunk, bits):
    """Chunks over cached prefixes and whole prompts, plain and int8 caches."""
    q, k, v, k_cache, v_cache, table, *rest = prefill_case([(5, 5), (20, 45), (1, 17), (70, 70), (3, 100)], dtype)
    quant = quantize_case(k_cache, v_cache, bits) if bits else (k_cache, v_cache)
    case = (q, k, v, *quant[:2], table, *rest, 0.3, *quant[2:], *((bits,) if bits else ()))
    ref = attention.prefill_attention(*as_float(case), attention_chunk=chunk)
    assert_close(triton_kernels.prefill_attention(*case, attention_chunk=chunk), ref, dtype)
    assert (ref - attention.prefill_attention(*as_float(case))).abs().max() > 1e-2


@pytest.mark.parametrize('chunk', [8, 24])
def test_given_back_pages_change_nothing(chunk):
    """Decode (the default launch and one of several pages per split) and prefill chunks over tables whose
    given-back entries read a page of NaN: the same outputs, to the bit."""
    q, k_cache, v_cache, table, kv_lens = paged_case([1, 37, 16, 90, 300], 6, 2, torch.float32, 24)
    junk_caches, junk_table, count = give_back((k_cache, v_cache), table, (kv_lens - 1).tolist(), chunk, BLOCK_SIZE)
    assert count > 0
    for launch in (triton_kernels.decode_attention,
                   functools.partial(decode_attention_with, config=DecodeConfig(3, 2, 4, 1))):
        expected = launch(q, k_cache, v_cache, table, kv_lens, 0.2, attention_chunk=chunk)
        assert torch.equal(launch(q, *junk_caches, junk_table, kv_lens, 0.2, attention_chunk=chunk), expected)
    q, k, v, k_cache, v_cache, table, q_start, q_len, ctx_len, max_q_len = prefill_case(
        [(5, 5), (20, 45), (1, 17), (70, 70), (3, 100)], torch.float32)
    junk_caches, junk_table, count = give_back((k_cache, v_cache), table, (ctx_len - q_len).tolist(), chunk,
                                               BLOCK_SIZE)
    assert count > 0
    rest = (q_start, q_len, ctx_len, max_q_len, 0.3)
    expected = triton_kernels.prefill_attention(q, k, v, k_cache, v_cache, table, *rest, attention_chunk=chunk)
    out = triton_kernels.prefill_attention(q, k, v, *junk_caches, junk_table, *rest, attention_chunk=chunk)
    assert torch.equal(out, expected)


def test_decode_empty_sequence_gives_zeros():
    """A padded row of a captured batch (``kv_len`` 0) yields zeros, and its neighbours stay exact."""
    q, k_cache, v_cache, table, kv_lens = paged_case([50, 0, 20], 4, 2, torch.float32, 8)
    out = decode_attention_with(q, k_cache, v_cache, table, kv_lens, 0.2, DecodeConfig(1, 2, 4, 2), attention_chunk=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = torch.tensor([0, 2], device=q.device)
    ref = attention.decode_attention(q[keep], k_cache, v_cache, table[keep], kv_lens[keep], 0.2, attention_chunk=16)
    assert_close(out[keep], ref, torch.float32)


def test_a_window_with_a_chunk_is_rejected():
    case = paged_case([10], 4, 2, torch.float32)
    with pytest.raises(ValueError, match='not both'):
        triton_kernels.decode_attention(*case, 0.2, sliding_window=4, attention_chunk=8)
