"""Multi-head latent attention kernels: the torch twin against attention over per-head K/V expanded from the
latents, the native CPU kernels and the Triton kernels (interpreter on CPU) against the twin, over latent
caches in the model dtype and in int8/int4 (``quant_policy`` 8/4)."""
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


def quantized(cache: torch.Tensor, policy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache``'s codes and scales and zeros; its rotary part scaled apart from the latent, as a rotary key
    can be, so that one shared scale would show."""
    cache = torch.cat((cache[..., :LATENT], cache[..., LATENT:] * 8), dim=-1)
    return mla.quantize_latent(cache, LATENT, policy)


def unpacked(codes: torch.Tensor, policy: int) -> torch.Tensor:
    """One int code per feature: int4 bytes unpacked part by part."""
    if policy == 8:
        return codes.int()
    parts = codes.split([LATENT // 2, ROPE // 2], dim=-1)
    return torch.cat([torch.cat((part & 15, part >> 4), -1) for part in parts], -1).int()


def dequantized(codes: torch.Tensor, scales_zeros: torch.Tensor, policy: int) -> torch.Tensor:
    return mla.dequantize_latent(codes, scales_zeros, LATENT, policy, torch.float32)


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


@pytest.mark.parametrize('policy', [8, 4])
def test_quantized_latent_keeps_each_part_to_its_own_step(policy):
    """Each token's latent and rotary key get a scale and zero point of their own: the round trip errs by at
    most half a step of that part's range, and the fill writes the codes the scheme gives."""
    cache, table = latent_cache([40])
    codes, sz = quantized(cache, policy)
    assert codes.shape == (*cache.shape[:2], (LATENT + ROPE) * policy // 8) and sz.shape == (*cache.shape[:2], 2, 2)
    values = torch.cat((cache[..., :LATENT], cache[..., LATENT:] * 8), dim=-1)
    error = (dequantized(codes, sz, policy) - values).abs()
    for part, dims in ((0, slice(None, LATENT)), (1, slice(LATENT, None))):
        step = sz[..., part, 0:1]
        assert torch.all(error[..., dims] <= step * 0.5 + 1e-6)
    filled, filled_sz = torch.zeros_like(codes), torch.zeros_like(sz)
    blocks, offsets = torch.tensor([2, 0, 2]), torch.tensor([5, 0, 15])
    mla.fill_latent_cache(values[blocks, offsets], filled, blocks, offsets, filled_sz, policy, LATENT)
    assert torch.equal(filled[blocks, offsets], codes[blocks, offsets])
    assert torch.equal(filled_sz[blocks, offsets], sz[blocks, offsets])


@pytest.mark.parametrize('policy', [8, 4])
def test_quantized_twin_attends_over_the_dequantized_cache(policy):
    """Decode and prefill over a quantized cache equal them over the cache dequantized up front; prefill reads
    the cache even for a chunk that is its whole context."""
    lengths = [5, 37]
    cache, table = latent_cache(lengths, seed=13)
    codes, sz = quantized(cache, policy)
    plain = dequantized(codes, sz, policy)
    q = rand(2, 3, LATENT + ROPE, seed=14)
    kv_lens = torch.tensor(lengths)
    torch.testing.assert_close(mla.mla_decode_attention(q, codes, table, kv_lens, 0.2, LATENT, sz, policy),
                               mla.mla_decode_attention(q, plain, table, kv_lens, 0.2, LATENT))
    q = rand(42, 3, LATENT + ROPE, seed=15)
    args = [torch.tensor(x) for x in ([0, 5], [5, 37], lengths)]
    fresh = torch.zeros(42, LATENT + ROPE)  # never read: a quantized cache already holds the chunk
    expected = mla.mla_prefill_attention(q, torch.cat([context(plain, table, row, n) for row, n in enumerate(lengths)]),
                                         plain, table, *args, 37, 0.3, LATENT)
    torch.testing.assert_close(mla.mla_prefill_attention(q, fresh, codes, table, *args, 37, 0.3, LATENT, sz, policy),
                               expected)


NATIVE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def cache_for(cache: torch.Tensor, policy: int) -> tuple[torch.Tensor, tuple]:
    """The cache kernels take, and the arguments after ``v_dim``: ``cache`` itself, or its codes then
    ``(scales_zeros, policy)``."""
    if not policy:
        return cache, ()
    codes, sz = quantized(cache.float(), policy)
    return codes.to(cache.device), (sz.to(cache.device), policy)


@pytest.mark.parametrize('policy', [0, 8, 4])
@pytest.mark.parametrize('dtype', sorted(NATIVE_TOL, key=str))
def test_native_decode_and_prefill_match_twin(native, dtype, policy):
    lengths, num_heads = [1, 37, 16, 90], 12  # two head groups, the second partial
    cache, table = latent_cache(lengths, dtype, seed=9)
    cache, quant = cache_for(cache, policy)
    q = rand(len(lengths), num_heads, LATENT + ROPE, seed=10, dtype=dtype)
    kv_lens = torch.tensor(lengths)
    out = native.mla_decode_attention(q, cache, table, kv_lens, 0.2, LATENT, *quant)
    ref = mla.mla_decode_attention(q.float(), cache if policy else cache.float(), table, kv_lens, 0.2, LATENT,
                                   *quant)
    torch.testing.assert_close(out.float(), ref, atol=NATIVE_TOL[dtype], rtol=NATIVE_TOL[dtype])
    chunks = [(5, 5), (20, 45), (1, 17), (16, 32)]
    q_lens, ctx_lens = [n for n, _ in chunks], [c for _, c in chunks]
    args = [torch.tensor(x) for x in ([sum(q_lens[:i]) for i in range(len(chunks))], q_lens, ctx_lens)]
    dense, table = latent_cache(ctx_lens, dtype, seed=11)
    cache, quant = cache_for(dense, policy)
    latent = torch.cat([context(dense, table, row, c)[c - n:] for row, (n, c) in enumerate(chunks)])
    q = rand(sum(q_lens), num_heads, LATENT + ROPE, seed=12, dtype=dtype)
    out = native.mla_prefill_attention(q, latent, cache, table, *args, max(q_lens), 0.3, LATENT, *quant)
    ref = mla.mla_prefill_attention(q.float(), latent.float(), cache if policy else cache.float(), table, *args,
                                    max(q_lens), 0.3, LATENT, *quant)
    torch.testing.assert_close(out.float(), ref, atol=NATIVE_TOL[dtype], rtol=NATIVE_TOL[dtype])


def as_read(cache: torch.Tensor, quant: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 cache the Triton kernels attend over: a quantized one dequantized to ``dtype`` first."""
    return (mla.dequantize_latent(cache, quant[0], LATENT, quant[1], dtype) if quant else cache).float()


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
    # the last: pages of 64 rows, read in steps of fewer rows (partial last pages)
    @pytest.mark.parametrize('policy', [0, 8, 4])
    @pytest.mark.parametrize('lengths,num_heads,width,block_size', [([1, 37, 16, 90], 6, 0, BLOCK_SIZE),
                                                                    ([40, 7], 20, 64, BLOCK_SIZE),
                                                                    ([1, 100, 64, 300], 20, 0, 64)])
    def test_decode(self, lengths, num_heads, width, block_size, policy):
        for dtype in self.dtypes:
            dense, table = latent_cache(lengths, dtype, self.device, block_size=block_size)
            cache, quant = cache_for(dense, policy)
            if width > table.shape[1]:
                table = torch.cat([table, table.new_zeros(len(lengths), width - table.shape[1])], dim=1)
            q = rand(len(lengths), num_heads, LATENT + ROPE, seed=6, dtype=dtype, device=self.device)
            kv_lens = torch.tensor(lengths, device=self.device)
            out = self.triton.mla_decode_attention(q, cache, table, kv_lens, 0.2, LATENT, *quant)
            ref = mla.mla_decode_attention(q.float(), as_read(cache, quant, dtype), table, kv_lens, 0.2, LATENT)
            torch.testing.assert_close(out.float(), ref, atol=self.tol(dtype), rtol=self.tol(dtype))

    @pytest.mark.parametrize('policy', [0, 8, 4])
    @pytest.mark.parametrize('chunks', [[(5, 5), (20, 45), (1, 17), (16, 32)], [(70, 70), (3, 100)]])
    def test_prefill(self, chunks, policy):
        q_lens, ctx_lens = [n for n, _ in chunks], [c for _, c in chunks]
        args = [torch.tensor(x, device=self.device) for x in ([sum(q_lens[:i]) for i in range(len(chunks))],
                                                              q_lens, ctx_lens)]
        for dtype in self.dtypes:
            dense, table = latent_cache(ctx_lens, dtype, self.device, seed=7)
            cache, quant = cache_for(dense, policy)
            latent = torch.cat([context(dense, table, row, c)[c - n:] for row, (n, c) in enumerate(chunks)])
            q = rand(sum(q_lens), 4, LATENT + ROPE, seed=8, dtype=dtype, device=self.device)
            out = self.triton.mla_prefill_attention(q, latent, cache, table, *args, max(q_lens), 0.3, LATENT, *quant)
            read = as_read(cache, quant, dtype)
            latent = torch.cat([context(read, table, row, c)[c - n:] for row, (n, c) in enumerate(chunks)])
            ref = mla.mla_prefill_attention(q.float(), latent, read, table, *args, max(q_lens), 0.3, LATENT)
            torch.testing.assert_close(out.float(), ref, atol=self.tol(dtype), rtol=self.tol(dtype))

    @pytest.mark.parametrize('policy', [8, 4])
    def test_fill_quantized(self, policy):
        """The fill writes the codes and (scale, zero) of each part that the twin writes (a code may be off by
        one where the GPU fuses a multiply-add)."""
        blocks = torch.tensor([4, 4, 1, 0, 0, 2], device=self.device)
        offsets = torch.tensor([0, 3, 7, 1, 2, 5], device=self.device)
        for dtype in self.dtypes:
            latent = rand(6, LATENT + ROPE, seed=16, dtype=dtype, device=self.device)
            latent[:, LATENT:] *= 8
            caches = [(torch.zeros(5, 8, (LATENT + ROPE) * policy // 8, dtype=torch.uint8, device=self.device),
                       torch.zeros(5, 8, 2, 2, device=self.device)) for _ in range(2)]
            self.triton.fill_latent_cache(latent, caches[0][0], blocks, offsets, caches[0][1], policy, LATENT)
            mla.fill_latent_cache(latent, caches[1][0], blocks, offsets, caches[1][1], policy, LATENT)
            torch.testing.assert_close(caches[0][1], caches[1][1], atol=0, rtol=1e-6)
            mine, ref = (unpacked(codes, policy) for codes, _ in caches)
            assert (mine - ref).abs().max() <= 1
