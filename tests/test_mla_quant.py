"""An int8/int4 latent KV cache (``quant_policy`` 8/4) for multi-head latent attention, on a tiny random
DeepSeek-V3 (fp32, CPU: the native kernels where they build): the cache's layout and size, greedy tokens
against the unquantized cache, and prefix caching and chunked prefill changing nothing."""
from __future__ import annotations

import logging

import pytest
from test_deepseek import KV_LORA_RANK, ROPE_DIM, save_deepseek

from helpers import make_engine, random_prompts, run

PROMPTS = [5, 37, 70, 130]  # lengths; 130 + 32 tokens span 11 blocks of 16


@pytest.fixture(scope='module')
def deepseek_v3(tmp_path_factory) -> str:
    return save_deepseek(str(tmp_path_factory.mktemp('v3')))


@pytest.fixture(scope='module')
def outputs(deepseek_v3) -> dict[int, list[list[int]]]:
    """Each policy's 32 greedy tokens for the prompts, run together."""
    prompts = random_prompts(PROMPTS)
    return {policy: run(make_engine(deepseek_v3, quant_policy=policy), prompts) for policy in (0, 8, 4)}


def test_engine_caches_the_quantized_latent(deepseek_v3, caplog):
    """Per token and layer: the codes of the latent and of the rotary key, and a (scale, zero) for each; the
    start-up log gives the kind, the bytes per token and the capacity, which grows by the bytes saved."""
    width = KV_LORA_RANK + ROPE_DIM
    per_layer = {0: width * 4, 8: width + 16, 4: width // 2 + 16}  # fp32; codes and two (scale, zero) pairs
    tokens = {}
    for policy, kind in ((0, 'float32'), (8, 'int8'), (4, 'int4')):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger='lmdeploy'):
            engine = make_engine(deepseek_v3, quant_policy=policy, num_gpu_blocks=0, max_cache_bytes=1 << 20,
                                 cache_max_entry_count=1.0)
        shapes = [tuple(t.shape[1:]) for t in engine.runner.kv_caches[0]]
        assert shapes == ([(16, width)] if not policy else [(16, width * policy // 8), (16, 2, 2)])
        assert engine.runner.cfg.kv_bytes_per_token() == 3 * per_layer[policy]
        tokens[policy] = engine.runner.scratch_block * 16
        assert f'{tokens[policy]} tokens' in caplog.text and f'{3 * per_layer[policy]} bytes per token' in caplog.text
        assert f'{kind} latent (MLA) (quant_policy {policy})' in caplog.text
    for policy in (8, 4):
        assert tokens[policy] / tokens[0] == pytest.approx(per_layer[0] / per_layer[policy], rel=0.02)


def test_int8_gives_the_unquantized_tokens(outputs):
    """Measured: int8 keeps every one of the 4 x 32 greedy tokens."""
    assert outputs[8] == outputs[0]


def test_int4_runs_and_starts_like_unquantized(outputs):
    """int4 is lossy, and the tiny random model's logits are nearly flat (measured: first-step logits within
    4-15% of their largest magnitude, the first tokens of 2 prompts of 4 the same, 18 of 128 tokens in place)."""
    assert all(len(tokens) == 32 for tokens in outputs[4])
    assert sum(a[0] == b[0] for a, b in zip(outputs[0], outputs[4])) >= 2


@pytest.mark.parametrize('policy', [8, 4])
def test_prefix_cache_and_chunked_prefill_change_nothing(deepseek_v3, outputs, policy):
    """A quantized cache is read back for every chunk, so cached prefixes, chunks and batching give the same
    tokens as one whole prefill per prompt."""
    prompts = random_prompts(PROMPTS)
    solo = make_engine(deepseek_v3, quant_policy=policy, enable_prefix_caching=False)
    assert [run(solo, [p])[0] for p in prompts] == outputs[policy]
    chunked = make_engine(deepseek_v3, quant_policy=policy, max_prefill_token_num=16)
    assert run(chunked, prompts) == outputs[policy]
    shared = prompts[3][:64]
    cached = make_engine(deepseek_v3, quant_policy=policy)
    run(cached, [shared + [5]])  # publishes the shared blocks
    tails = random_prompts([7, 20], seed=4)
    expected = run(make_engine(deepseek_v3, quant_policy=policy, enable_prefix_caching=False),
                   [shared + t for t in tails])
    assert run(cached, [shared + t for t in tails]) == expected
    assert cached.block_manager.num_hits > 0


def test_tp2_gives_one_ranks_tokens(deepseek_v3, outputs):
    """Each rank quantizes and reads its own copy of the whole latent cache for its heads."""
    engine = make_engine(deepseek_v3, quant_policy=8, tp=2)
    try:
        assert run(engine, random_prompts(PROMPTS)) == outputs[8]
    finally:
        engine.close()
