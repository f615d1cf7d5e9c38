"""KV-cache quantization (``quant_policy`` 8 and 4): the torch twin against dequantize-then-attend, the
native CPU kernels against the twin, and the engine end to end on tiny models."""
from __future__ import annotations

import logging

import pytest
import torch
from helpers import make_engine, random_prompts, run, scattered_block_table

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import attention
from lmdeploy.pytorch.kernels.kv_quant import dequantize_kv, quantize_kv

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def quantized_case(lengths: list[int], num_kv_heads: int, block_size: int, head_dim: int, bits: int,
                   seed: int = 0):
    """Random caches quantized with the twin: ``(k_codes, v_codes, k_sz, v_sz, block_table)``."""
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = scattered_block_table(lengths, block_size, g)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    (k, k_sz), (v, v_sz) = (quantize_kv(torch.randn(shape, generator=g) * 2 + 0.5, bits) for _ in range(2))
    return k, v, k_sz, v_sz, table


def dequantized(case, bits: int, dtype: torch.dtype):
    k, v, k_sz, v_sz, _ = case
    return dequantize_kv(k, k_sz, bits, dtype), dequantize_kv(v, v_sz, bits, dtype)


@pytest.mark.parametrize('bits', [8, 4])
def test_quantize_round_trip_is_within_half_a_step(bits):
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 4
    x[0, 0] = 0.25  # a constant row: scale clamped, no NaN
    codes, sz = quantize_kv(x, bits)
    assert codes.shape == (50, 3, 64 * bits // 8) and codes.dtype == torch.uint8 and sz.dtype == torch.float32
    back = dequantize_kv(codes, sz, bits, torch.float32)
    assert torch.all((back - x).abs() <= sz[..., :1] * 0.5 + 1e-6)
    assert torch.equal(back[0, 0], x[0, 0])


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_twin_attends_over_the_dequantized_cache(bits, dtype):
    torch.manual_seed(0)
    lengths = [1, 16, 17, 70]
    case = quantized_case(lengths, 2, 16, 32, bits)
    k_deq, v_deq = dequantized(case, bits, dtype)
    q = torch.randn(len(lengths), 4, 32).to(dtype)
    kv_lens = torch.tensor(lengths)
    out = attention.decode_attention(q, case[0], case[1], case[4], kv_lens, 0.2, case[2], case[3], bits)
    expected = attention.decode_attention(q, k_deq, v_deq, case[4], kv_lens, 0.2)
    assert torch.equal(out, expected)
    # prefill: whole-context chunks read the cache too, so the reference's fresh K/V are dequantized ones
    q_lens = [1, 10, 17, 30]
    q_start = [sum(q_lens[:i]) for i in range(4)]
    fresh_k, fresh_v = (torch.empty(sum(q_lens), 2, 32, dtype=dtype) for _ in range(2))
    for row, (start, n, c) in enumerate(zip(q_start, q_lens, lengths)):
        blocks = case[4][row, :-(-c // 16)]
        fresh_k[start:start + n] = attention._gather_context(k_deq[blocks], c)[:, c - n:].transpose(0, 1)
        fresh_v[start:start + n] = attention._gather_context(v_deq[blocks], c)[:, c - n:].transpose(0, 1)
    q = torch.randn(sum(q_lens), 4, 32).to(dtype)
    args = (case[4], torch.tensor(q_start), torch.tensor(q_lens), kv_lens, 30, 0.2)
    zeros = torch.zeros_like(fresh_k)  # never read with a quantized cache
    out = attention.prefill_attention(q, zeros, zeros, case[0], case[1], *args, case[2], case[3], bits)
    expected = attention.prefill_attention(q, fresh_k, fresh_v, k_deq, v_deq, *args)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize('dim', [64, 40])
def test_native_fill_matches_twin(native, bits, dtype, dim):
    """The AVX-512 quantizer takes 16 values a step; 40 leaves a partial last step."""
    torch.manual_seed(0)
    k, v = (torch.randn(40, 3, dim + 2).to(dtype)[..., :dim] for _ in range(2))  # strided rows
    slots = torch.randperm(96)[:40]
    blocks, offsets = slots // 16, slots % 16
    caches = [[torch.zeros(6, 3, 16, dim * bits // 8, dtype=torch.uint8) for _ in range(2)]
              + [torch.zeros(6, 3, 16, 2) for _ in range(2)] for _ in range(2)]
    native.fill_kv_cache(k, v, caches[0][0], caches[0][1], blocks, offsets, caches[0][2], caches[0][3], bits)
    attention.fill_kv_cache(k, v, caches[1][0], caches[1][1], blocks, offsets, caches[1][2], caches[1][3], bits)
    for mine, ref in zip(caches[0][2:], caches[1][2:]):
        torch.testing.assert_close(mine, ref, atol=0, rtol=1e-6)
    for mine, ref in zip(caches[0][:2], caches[1][:2]):
        if bits == 4:
            mine, ref = torch.cat((mine & 15, mine >> 4), -1), torch.cat((ref & 15, ref >> 4), -1)
        diff = (mine.int() - ref.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # a code off by one where x sits on a .5


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('num_heads,num_kv_heads,head_dim', [(9, 3, 64), (4, 2, 32), (16, 2, 128), (6, 1, 64)])
@pytest.mark.parametrize('block_size,copies', [(16, 1), (24, 6), (128, 1)])
def test_native_decode_matches_twin(native, bits, dtype, num_heads, num_kv_heads, head_dim, block_size, copies):
    """bf16 with head_dim 64/128 takes the AVX-512 path (int16 query . codes, int16 weights . codes for the
    values, 64 keys at a time: blocks of 128 take two); the rest the generic loop. Many rows: a task per
    row; few: a task per KV head."""
    torch.manual_seed(0)
    lengths = [1, 16, 17, 100, 64, 3, 47] * copies
    case = quantized_case(lengths, num_kv_heads, block_size, head_dim, bits)
    q = torch.randn(len(lengths), num_heads + 2, head_dim).to(dtype)[:, :num_heads]
    kv_lens = torch.tensor(lengths)
    expected = attention.decode_attention(q.float(), case[0], case[1], case[4], kv_lens, 0.1, case[2], case[3], bits)
    out = native.paged_decode_attention(q, case[0], case[1], case[4], kv_lens, 0.1, case[2], case[3], bits)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('num_heads,num_kv_heads,head_dim', [(9, 3, 64), (4, 2, 32), (8, 2, 128)])
def test_native_prefill_matches_twin(native, bits, dtype, num_heads, num_kv_heads, head_dim):
    """bf16 with head_dim 64/128 packs the GEMM panels from the dequantized rows (bf16, as the twin
    dequantizes): the same as the plain kernel over the cache dequantized up front. K/V of up to |8|
    over contexts of up to 150 make bf16's rounding of them show against the fp32 twin."""
    torch.manual_seed(0)
    chunks = [(5, 5), (20, 45), (1, 17), (70, 70), (40, 150)]  # (q_len, ctx_len)
    q_lens, ctx_lens = [n for n, _ in chunks], [c for _, c in chunks]
    case = quantized_case(ctx_lens, num_kv_heads, 24, head_dim, bits)
    q_start = torch.tensor([sum(q_lens[:i]) for i in range(len(chunks))])
    q = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype)
    fresh = torch.zeros(sum(q_lens), num_kv_heads, head_dim, dtype=dtype)  # never read with a quantized cache
    args = (case[4], q_start, torch.tensor(q_lens), torch.tensor(ctx_lens), max(q_lens), 0.3)
    out = native.paged_prefill_attention(q, fresh, fresh, case[0], case[1], *args, case[2], case[3], bits)
    expected = attention.prefill_attention(q.float(), fresh.float(), fresh.float(), case[0], case[1], *args, case[2],
                                           case[3], bits)
    tolerance = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (0.1, 2e-2)}[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tolerance[0], rtol=tolerance[1])
    if dtype == torch.bfloat16 and head_dim in (64, 128):
        plain = native.paged_prefill_attention(q, fresh, fresh, *dequantized(case, bits, dtype), *args)
        torch.testing.assert_close(out, plain, atol=1e-2, rtol=1e-2)


def test_bad_quant_policy_is_a_clear_error():
    for bad in (1, 2, 16, True, '8'):
        with pytest.raises(ValueError, match='quant_policy'):
            PytorchEngineConfig(quant_policy=bad)


def test_cli_flag_reaches_the_config():
    import argparse

    from lmdeploy.cli.args import add_engine_args, engine_config
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(['--quant-policy', '8'])).quant_policy == 8
    assert engine_config(parser.parse_args([])).quant_policy == 0
    with pytest.raises(SystemExit):
        parser.parse_args(['--quant-policy', '3'])


GREEDY_24 = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope='module')
def outputs(tiny_llama):
    """Each policy's greedy tokens for a few prompts, run together (fp32 tiny model)."""
    prompts = random_prompts([5, 37, 70, 130])
    return prompts, {policy: run(make_engine(tiny_llama, quant_policy=policy), prompts, GREEDY_24)
                     for policy in (0, 8, 4)}


def test_int8_gives_the_unquantized_tokens(outputs):
    """Measured on the fp32 tiny model: int8 keeps every greedy token of 4 prompts over 24 steps."""
    _, out = outputs
    assert out[8] == out[0]


def test_int4_runs_and_starts_like_unquantized(outputs):
    """int4 is lossy: on the tiny random model (weights N(0, 0.2), a chaotic net) the first tokens agree."""
    _, out = outputs
    assert all(len(tokens) == 24 for tokens in out[4])
    assert sum(a[0] == b[0] for a, b in zip(out[0], out[4])) >= 3


@pytest.mark.parametrize('policy', [8, 4])
def test_batched_equals_solo(tiny_llama, outputs, policy):
    prompts, out = outputs
    engine = make_engine(tiny_llama, quant_policy=policy)
    assert [run(engine, [p], GREEDY_24)[0] for p in prompts] == out[policy]


@pytest.mark.parametrize('policy', [8, 4])
def test_prefix_cache_and_chunked_prefill_change_nothing(tiny_llama, policy):
    shared = random_prompts([100], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([7, 20], seed=4)]
    plain = run(make_engine(tiny_llama, quant_policy=policy, enable_prefix_caching=False), prompts, GREEDY_24)
    cached_engine = make_engine(tiny_llama, quant_policy=policy)
    run(cached_engine, [shared + [5]], GREEDY_24)  # publishes the shared blocks
    assert [run(cached_engine, [p], GREEDY_24)[0] for p in prompts] == plain
    chunked = make_engine(tiny_llama, quant_policy=policy, enable_prefix_caching=False, max_prefill_token_num=32)
    assert run(chunked, prompts, GREEDY_24) == plain


@pytest.mark.parametrize('policy', [8, 4])
def test_preemption_changes_nothing(tiny_llama, policy):
    prompts = random_prompts([40, 45, 50], seed=5)
    roomy = run(make_engine(tiny_llama, quant_policy=policy), prompts, GREEDY_24)
    tight = make_engine(tiny_llama, quant_policy=policy, num_gpu_blocks=10)  # 160 tokens for 3 x 74
    assert run(tight, prompts, GREEDY_24) == roomy


def test_capacity_grows_with_the_policy(tiny_llama, caplog):
    """The same byte budget holds more blocks: head_dim 16 in fp32 is 64 bytes a row against 16 + 8
    (int8, scale and zero included) and 8 + 8 (int4)."""
    blocks = {}
    for policy in (0, 8, 4):
        with caplog.at_level(logging.INFO, logger='lmdeploy'):
            engine = make_engine(tiny_llama, quant_policy=policy, num_gpu_blocks=0, max_cache_bytes=1 << 20,
                                 cache_max_entry_count=1.0)
        blocks[policy] = engine.runner.scratch_block
        assert f'quant_policy {policy}' in caplog.text and f'{blocks[policy] * 16} tokens' in caplog.text
    assert blocks[8] / blocks[0] == pytest.approx(64 / 24, rel=0.02)
    assert blocks[4] / blocks[0] == pytest.approx(64 / 16, rel=0.02)


@pytest.fixture(scope='module')
def llama_head_dim_64(tmp_path_factory) -> str:
    """Head_dim 64, so that bf16 runs the AVX-512 attention paths."""
    from conftest import save_tiny_model
    return save_tiny_model('llama', str(tmp_path_factory.mktemp('llama64')), hidden_size=256, head_dim=64,
                           num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize('policy', [8, 4])
def test_native_decoder_stack_reads_the_quantized_cache(llama_head_dim_64, policy, native_gemms):
    """bf16: the native decoder stack gives the layers' own tokens over a quantized cache (the same
    native kernels in the same order), through chunked prefills, mixed and decode steps."""
    config = PytorchEngineConfig(dtype='bfloat16', quant_policy=policy, num_gpu_blocks=64, block_size=16,
                                 enable_prefix_caching=False, max_prefill_token_num=48)
    engine = Engine(llama_head_dim_64, config, show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None
    prompts = random_prompts([20, 70, 9, 33], seed=8)
    stacked = run(engine, prompts, GREEDY_24)
    model.native_stack = None
    assert run(engine, prompts, GREEDY_24) == stacked


def test_vision_language_model(tmp_path):
    """Images go through the same attention: chunked prefill cutting through images, preemption and a
    prefix-cache hit give the roomy run's tokens under int8."""
    from vl_models import VL_KINDS, random_image, save_tiny_vl_model

    from lmdeploy import pipeline
    path = save_tiny_vl_model(VL_KINDS[0], str(tmp_path))
    prompts = [('describe', random_image(1)), ('what is this', random_image(2, (60, 60)))]
    outs = []
    for config in (dict(num_gpu_blocks=64, block_size=16), dict(num_gpu_blocks=20, block_size=4,
                                                                  max_prefill_token_num=5)):
        with pipeline(path, PytorchEngineConfig(dtype='float32', quant_policy=8, **config),
                      show_progress=False) as pipe:
            outs.append([r.token_ids for r in pipe(prompts, gen_config=GREEDY_24)])
            preempted = pipe.async_engine.engine.scheduler.num_preemptions > 0
            again = pipe(prompts[0], gen_config=GREEDY_24)
            assert again.cached_tokens > 0 and again.token_ids == outs[-1][0]
    assert outs[0] == outs[1] and preempted


def test_tensor_parallel_ranks_quantize_their_own_heads(tiny_llama, outputs):
    """tp=2: each rank holds int8 codes and scales for its one KV head; the tokens are tp=1's."""
    prompts, out = outputs
    engine = make_engine(tiny_llama, quant_policy=8, tp=2)
    try:
        assert run(engine, prompts, GREEDY_24) == out[8]
        assert [t.shape[1] for t in engine.runner.kv_caches[0]] == [1] * 4
    finally:
        engine.close()


@pytest.mark.parametrize('policy', [8, 4])
def test_decode_graphs_with_a_quantized_cache(tiny_llama, policy):
    """The decode graph runner (capture replaced by a recorder, see test_cuda_graph.py) with padded
    batches writing codes and scales to the scratch block gives the eager tokens."""
    from test_cuda_graph import MAX_BATCH, generate, ragged_requests, with_recorded_graphs
    requests = ragged_requests()
    eager = generate(make_engine(tiny_llama, max_batch_size=MAX_BATCH, quant_policy=policy), requests)
    engine = with_recorded_graphs(make_engine(tiny_llama, max_batch_size=MAX_BATCH, quant_policy=policy))
    assert generate(engine, requests) == eager
    assert all(graph.replays > 0 for graph in engine.runner.graphs.graphs.values())
