"""Batch invariance of the Triton decode kernels (interpreter on the CPU): a sequence's output is the same, to the
bit, alone, in batches of other sequences of other lengths (a padded graph row of no tokens among them) and in a
block table padded wider, as a CUDA graph's is."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_env import DEVICE
from test_kernels_attention import paged_cache, quantize_case, rand
from test_kernels_mla import LATENT, ROPE, cache_for, latent_cache

from lmdeploy.pytorch.kernels import cuda as triton_kernels
from lmdeploy.pytorch.kernels.cuda.decode_attention import DecodeConfig, decode_attention_with
from lmdeploy.pytorch.kernels.cuda.mla import mla_decode_attention

pytestmark = pytest.mark.triton
# Row 0 is the sequence checked: 35 pages of 64 tokens. Under the earlier policy its split count fell from 35 alone
# to 33 in the batch of 8 (32 rows of 4 KV heads or of 2 MLA head groups), so its pages were merged in other groups.
LENGTHS = [2200, 5, 300, 0, 64, 130, 33, 129]
BLOCK_SIZE = 64
BATCHES = [[2, 0, 3, 4], [5, 6, 7, 0, 1, 2, 3, 4]]  # rows of the case; row 0 at different places
PAD = 13  # extra block-table columns


def padded(table: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([table, table.new_zeros(table.shape[0], width - table.shape[1])], dim=1)


def assert_batch_invariant(run: Callable, q: torch.Tensor, table: torch.Tensor, kv_lens: torch.Tensor) -> None:
    """``run(q, table, kv_lens)`` over row 0 alone equals its row in the batches of ``BATCHES``, the first in the
    table padded by ``PAD`` columns (more splits in the grid), the second in the table as it is."""
    alone = run(q[:1], table[:1], kv_lens[:1])[0]
    assert alone.abs().max() > 0
    for rows, t in zip(BATCHES, (padded(table, table.shape[1] + PAD), table)):
        index = torch.tensor(rows, device=DEVICE)
        out = run(q[index], t[index], kv_lens[index])
        assert torch.equal(out[rows.index(0)], alone), f'batch {rows}, table width {t.shape[1]}'


DECODE_CASES = {  # (query heads, dtype, decode_attention keywords), over 4 KV heads
    'plain fp32': (4, torch.float32, {}),
    'plain fp16': (4, torch.float16, {}),
    'gqa': (12, torch.float32, {}),
    'window': (12, torch.float32, dict(sliding_window=700)),
    'softcap': (12, torch.float32, dict(logit_softcap=2.5)),
    'sinks': (12, torch.float32, dict(sinks='sinks')),
    'int8': (12, torch.float32, dict(quant_policy=8)),
}


@pytest.mark.parametrize('name,launch', [(name, 'default') for name in DECODE_CASES]
                         + [('gqa', 'small splits'), ('window', 'small splits')])
def test_decode_attention_is_batch_invariant(name, launch):
    """The default launch (4 pages per split), and one of 3 pages per split and 2 per step (ragged last steps and
    splits; the window's first split starts mid-page)."""
    num_heads, dtype, kwargs = DECODE_CASES[name]
    k_cache, v_cache, table = paged_cache(LENGTHS, 4, 32, dtype, block_size=BLOCK_SIZE)
    q, kv_lens = rand(len(LENGTHS), num_heads, 32, dtype=dtype), torch.tensor(LENGTHS, device=DEVICE)
    if kwargs.get('sinks'):
        kwargs = dict(sinks=rand(num_heads, dtype=torch.float32, seed=9) * 2)
    caches = (k_cache, v_cache)
    if kwargs.get('quant_policy'):
        k, v, k_sz, v_sz = quantize_case(k_cache, v_cache, 8)
        caches, kwargs = (k, v), dict(k_scales_zeros=k_sz, v_scales_zeros=v_sz, quant_policy=8)

    def run(q, table, kv_lens):
        if launch == 'default':
            return triton_kernels.decode_attention(q, *caches, table, kv_lens, 0.2, **kwargs)
        return decode_attention_with(q, *caches, table, kv_lens, 0.2, DecodeConfig(3, 2, 4, 2), **kwargs)

    assert_batch_invariant(run, q, table, kv_lens)


@pytest.mark.parametrize('policy', [0, 8])
def test_mla_decode_is_batch_invariant(policy):
    """20 heads: two head groups, the second partial."""
    dense, table = latent_cache(LENGTHS, device=DEVICE, block_size=BLOCK_SIZE)
    cache, quant = cache_for(dense, policy)
    q = rand(len(LENGTHS), 20, LATENT + ROPE, dtype=torch.float32, seed=6)

    def run(q, table, kv_lens):
        return mla_decode_attention(q, cache, table, kv_lens, 0.2, LATENT, *quant)

    assert_batch_invariant(run, q, table, torch.tensor(LENGTHS, device=DEVICE))
