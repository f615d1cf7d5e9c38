"""Multi-head latent attention kernels: the torch twin against attention over per-head K/V expanded from the
latents, the native CPU kernels and the Triton kernels (interpreter on CPU) against the twin."""
from __future__ import annotations

import pytest
import torch
from helpers import scattered_block_table

from lmdeploy.pytorch.kernels import mla

BLOCK_SIZE = 16
LATENT, ROPE, NOPE, V_HEAD = 32, 8, 16, 16


def rand(*shape, seed, dtype=torch.float32, device='cpu'):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def latent_cache(lengths: list[int], dtype=torch.float32, device='cpu', seed=0, block_size=BLOCK_SIZE):
    """A random latent cache and a block table giving each sequence scattered blocks for ``lengths`` tokens."""
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = scattered_block_table(lengths, block_size, g)
    cache = torch.randn(num_blocks, block_size, LATENT + ROPE, generator=g).to(device, dtype)
    return cache, table.to(device)


def context(cache, table, row, length):
    return cache[table[row, :-(-length // BLOCK_SIZE)]].flatten(0, 1)[:length]


def test_absorbed_twin_equals_expanded_attention():
    """Decode and chunked prefill over the latents, with W_UK absorbed into the queries and W_UV applied after,
    equal softmax attention over the per-head keys and values the latents expand to."""
    num_heads, lengths, chunk = 3, [5, 37], [2, 20]
    cache, table = latent_cache(lengths)
    w_kv = rand(num_heads, NOPE + V_HEAD, LATENT, seed=1) * 0.3
    q_nope, q_rope = rand(sum(chunk), num_heads, NOPE, seed=2), rand(sum(chunk), num_heads, ROPE, seed=3)
    q = torch.cat((torch.einsum('thn,hnl->thl', q_nope, w_kv[:, :NOPE]), q_rope), dim=-1)
    expected = []
    for row, (length, n) in enumerate(zip(lengths, chunk)):
        kv = context(cache, table, row, length)
        keys = torch.cat((torch.einsum('hnl,tl->htn', w_kv[:, :NOPE], kv[:, :LATENT]),
                          kv[:, LATENT:].expand(num_heads, -1, -1)), dim=-1)
        values = torch.einsum('hvl,tl->htv', w_kv[:, NOPE:], kv[:, :LATENT])
        rows = slice(sum(chunk[:row]), sum(chunk[:row + 1]))
        queries = torch.cat((q_nope[rows], q_rope[rows]), dim=-1).transpose(0, 1)
        scores = queries @ keys.transpose(1, 2) * 0.3
        causal = torch.arange(length) <= torch.arange(length - n, length).unsqueeze(1)
        expected.append((scores.masked_fill(~causal, float('-inf')).softmax(-1) @ values).transpose(0, 1))
    args = [torch.tensor(x) for x in ([0, chunk[0]], chunk, lengths)]
    latent = torch.cat([context(cache, table, row, c)[c - n:] for row, (n, c) in enumerate(zip(chunk, lengths))])
    prefill = mla.mla_prefill_attention(q, latent, cache, table, *args, max(chunk), 0.3, LATENT)
    torch.testing.assert_close(torch.einsum('thl,hvl->thv', prefill, w_kv[:, NOPE:]), torch.cat(expected))
    last = [sum(chunk[:i + 1]) - 1 for i in range(len(chunk))]
    decode = mla.mla_decode_attention(q[last], cache, table, torch.tensor(lengths), 0.3, LATENT)
    torch.testing.assert_close(torch.einsum('thl,hvl->thv', decode, w_kv[:, NOPE:]),
                               torch.stack([e[-1] for e in expected]))


def test_fresh_chunk_and_cached_prefix_agree():
    """A chunk that is its whole context attends over its fresh latents, a later chunk over the cache: the
    same rows either way."""
    cache, table = latent_cache([22])
    latent = context(cache, table, 0, 22)
    q = rand(22, 2, LATENT + ROPE, seed=4)
    whole = mla.mla_prefill_attention(q, latent, cache, table, torch.tensor([0]), torch.tensor([22]),
                                      torch.tensor([22]), 22, 0.2, LATENT)
    tail = mla.mla_prefill_attention(q[1:], latent[1:], cache, table, torch.tensor([0]), torch.tensor([21]),
                                     torch.tensor([22]), 21, 0.2, LATENT)
    torch.testing.assert_close(tail, whole[1:])


def test_fill_latent_cache_writes_each_token_to_its_slot():
    cache = torch.zeros(4, BLOCK_SIZE, LATENT + ROPE)
    latent = rand(3, LATENT + ROPE, seed=5)
    mla.fill_latent_cache(latent, cache, torch.tensor([2, 0, 2]), torch.tensor([5, 0, 15]))
    assert torch.equal(cache[2, 5], latent[0]) and torch.equal(cache[0, 0], latent[1])
    assert torch.equal(cache[2, 15], latent[2]) and cache.abs().sum() == latent.abs().sum()


NATIVE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize('dtype', sorted(NATIVE_TOL, key=str))
def test_native_decode_and_prefill_match_twin(native, dtype):
    lengths, num_heads = [1, 37, 16, 90], 12  # two head groups, the second partial
    cache, table = latent_cache(lengths, dtype, seed=9)
    q = rand(len(lengths), num_heads, LATENT + ROPE, seed=10, dtype=dtype)
    kv_lens = torch.tensor(lengths)
    out = native.mla_decode_attention(q, cache, table, kv_lens, 0.2, LATENT)
    ref = mla.mla_decode_attention(q.float(), cache.float(), table, kv_lens, 0.2, LATENT)
    torch.testing.assert_close(out.float(), ref, atol=NATIVE_TOL[dtype], rtol=NATIVE_TOL[dtype])
    chunks = [(5, 5), (20, 45), (1, 17), (16, 32)]
    q_lens, ctx_lens = [n for n, _ in chunks], [c for _, c in chunks]
    args = [torch.tensor(x) for x in ([sum(q_lens[:i]) for i in range(len(chunks))], q_lens, ctx_lens)]
    cache, table = latent_cache(ctx_lens, dtype, seed=11)
    latent = torch.cat([context(cache, table, row, c)[c - n:] for row, (n, c) in enumerate(chunks)])
    q = rand(sum(q_lens), num_heads, LATENT + ROPE, seed=12, dtype=dtype)
    out = native.mla_prefill_attention(q, latent, cache, table, *args, max(q_lens), 0.3, LATENT)
    ref = mla.mla_prefill_attention(q.float(), latent.float(), cache.float(), table, *args, max(q_lens), 0.3,
                                    LATENT)
    torch.testing.assert_close(out.float(), ref, atol=NATIVE_TOL[dtype], rtol=NATIVE_TOL[dtype])


@pytest.mark.triton
class TestTriton:
    """The Triton kernels against the twin (fp32 and fp16; bf16 on CUDA only, see kernel_env)."""

    @pytest.fixture(autouse=True)
    def _kernels(self):
        from kernel_env import DEVICE, DTYPES
        from lmdeploy.pytorch.kernels.cuda import mla as triton_mla
        self.device, self.dtypes, self.triton = DEVICE, DTYPES, triton_mla

    def tol(self, dtype):
        return {torch.float32: 2e-3 if self.device == 'cuda' else 1e-4, torch.float16: 3e-3,
                torch.bfloat16: 2e-2}[dtype]

    # the last: pages of 64 rows, read in steps of fewer rows (partial last pages)
    @pytest.mark.parametrize('lengths,num_heads,width,block_size', [([1, 37, 16, 90], 6, 0, BLOCK_SIZE),
                                                                    ([40, 7], 20, 64, BLOCK_SIZE),
                                                                    ([1, 100, 64, 300], 20, 0, 64)])
    def test_decode(self, lengths, num_heads, width, block_size):
        for dtype in self.dtypes:
            cache, table = latent_cache(lengths, dtype, self.device, block_size=block_size)
            if width > table.shape[1]:
                table = torch.cat([table, table.new_zeros(len(lengths), width - table.shape[1])], dim=1)
            q = rand(len(lengths), num_heads, LATENT + ROPE, seed=6, dtype=dtype, device=self.device)
            kv_lens = torch.tensor(lengths, device=self.device)
            out = self.triton.mla_decode_attention(q, cache, table, kv_lens, 0.2, LATENT)
            ref = mla.mla_decode_attention(q.float(), cache.float(), table, kv_lens, 0.2, LATENT)
            torch.testing.assert_close(out.float(), ref, atol=self.tol(dtype), rtol=self.tol(dtype))

    @pytest.mark.parametrize('chunks', [[(5, 5), (20, 45), (1, 17), (16, 32)], [(70, 70), (3, 100)]])
    def test_prefill(self, chunks):
        q_lens, ctx_lens = [n for n, _ in chunks], [c for _, c in chunks]
        args = [torch.tensor(x, device=self.device) for x in ([sum(q_lens[:i]) for i in range(len(chunks))],
                                                              q_lens, ctx_lens)]
        for dtype in self.dtypes:
            cache, table = latent_cache(ctx_lens, dtype, self.device, seed=7)
            latent = torch.cat([context(cache, table, row, c)[c - n:] for row, (n, c) in enumerate(chunks)])
            q = rand(sum(q_lens), 4, LATENT + ROPE, seed=8, dtype=dtype, device=self.device)
            out = self.triton.mla_prefill_attention(q, latent, cache, table, *args, max(q_lens), 0.3, LATENT)
            ref = mla.mla_prefill_attention(q.float(), latent.float(), cache.float(), table, *args, max(q_lens),
                                            0.3, LATENT)
            torch.testing.assert_close(out.float(), ref, atol=self.tol(dtype), rtol=self.tol(dtype))
