"""Prefill attention whose image tokens attend to every token of their image (``key_limit``: Gemma 3's
bidirectional image spans): the torch twin against a dense float64 reference with transformers' masking
(causal OR same image block, AND the sliding window), and the native CPU kernel against the twin, on its
generic, AVX-512 and AVX512-BF16 GEMM paths, plain and quantized caches."""
from __future__ import annotations

import pytest
import torch
from test_attention_features import as_float, case, dense_reference

from lmdeploy.pytorch.kernels import attention

CONTEXTS, CHUNKS = [23, 40, 9, 70], [23, 11, 1, 30]
# per sequence, [start, end) spans of tokens in its chunk that attend to each other: several in a whole prompt,
# one in a chunk over a cached prefix, one running to the chunk's last token, and one of a single token
SPANS = [[(3, 10), (12, 20)], [(31, 36)], [], [(41, 44), (55, 70)]]
WINDOWS = [None, 4, 16]


def key_limit(contexts: list[int], chunks: list[int], spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """The last key position of each packed row: its own, or its span's last."""
    limits = []
    for context, chunk, seq_spans in zip(contexts, chunks, spans):
        positions = list(range(context - chunk, context))
        for start, end in seq_spans:
            positions = [end - 1 if start <= p < end else p for p in positions]
        limits += positions
    return torch.tensor(limits)


def dense_with_spans(q, k, v, scale, window, spans):
    """``dense_reference`` with each span's queries seeing the whole span: their rows are the dense attention of
    the span's last token's context, masked as transformers masks a block (``kv <= span end``, window from the
    query)."""
    context, length = k.shape[0], q.shape[0]
    out = dense_reference(q, k, v, scale, window, None, None)
    for start, end in spans:
        for p in range(start, end):
            row = p - (context - length)
            lo = max(0, p - window + 1) if window else 0
            out[row] = dense_reference(q[row:row + 1], k[lo:end], v[lo:end], scale, None, None, None)[0]
    return out


@pytest.mark.parametrize('quant_policy', [0, 8])
@pytest.mark.parametrize('window', WINDOWS)
def test_twin_matches_the_dense_reference(window, quant_policy):
    (args, ks, vs) = case(CONTEXTS, CHUNKS, 6, 2, 16, torch.float32, quant_policy)
    out = attention.prefill_attention(*args, sliding_window=window, key_limit=key_limit(CONTEXTS, CHUNKS, SPANS))
    q, starts = args[0], args[6].tolist()
    for s, n in enumerate(CHUNKS):
        expected = dense_with_spans(q[starts[s]:starts[s] + n], ks[s], vs[s], 0.3, window, SPANS[s])
        torch.testing.assert_close(out[starts[s]:starts[s] + n].double(), expected, atol=2e-5, rtol=2e-5)


def test_twin_without_spans_is_causal():
    args, _, _ = case(CONTEXTS, CHUNKS, 6, 2, 16, torch.float32)
    torch.testing.assert_close(attention.prefill_attention(*args, key_limit=key_limit(CONTEXTS, CHUNKS, [[]] * 4)),
                               attention.prefill_attention(*args))


@pytest.mark.parametrize('dtype,head_dim', [(torch.float32, 32), (torch.bfloat16, 32), (torch.bfloat16, 64),
                                            (torch.bfloat16, 128)])
@pytest.mark.parametrize('quant_policy', [0, 8, 4])
@pytest.mark.parametrize('window', WINDOWS)
def test_native_matches_the_twin(native, dtype, head_dim, quant_policy, window):
    """fp32 takes the generic path; bf16 with head_dim 32 the AVX-512 rows, 64 and 128 the AVX512-BF16 GEMM path
    (where the CPU has it)."""
    args, _, _ = case(CONTEXTS, CHUNKS, 8, 2, head_dim, dtype, quant_policy, seed=3)
    f = dict(sliding_window=window, key_limit=key_limit(CONTEXTS, CHUNKS, SPANS))
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    expected = attention.prefill_attention(*as_float(args), **f)
    torch.testing.assert_close(native.paged_prefill_attention(*args, **f).float(), expected.float(), atol=tol,
                               rtol=tol)


def test_native_rejects_a_key_limit_out_of_its_sequence(native):
    args, _, _ = case(CONTEXTS, CHUNKS, 8, 2, 32, torch.float32)
    limits = key_limit(CONTEXTS, CHUNKS, SPANS)
    for bad in (CONTEXTS[0], 0):  # past the sequence's last token; before the row's own position
        wrong = limits.clone()
        wrong[5] = bad
        with pytest.raises(RuntimeError, match='key limit'):
            native.paged_prefill_attention(*args, key_limit=wrong)
