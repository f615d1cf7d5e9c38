"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against transformers on tiny random models whose ``index_topk`` (8) is
well below the test contexts: greedy tokens and first-step logits in fp32, batching, chunked prefill across the
top-k boundary, prefix-cache hits, tensor parallelism, the indexer keys' place in the KV cache, and that the
selection matters (dense attention gives other tokens)."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import DeepseekV32Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_deepseek import save_fp8_and_dense

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import dsa

KV_LORA_RANK, ROPE_DIM, INDEX_DIM, TOP_K = 32, 8, 16, 8
FP8_WEIGHTS = ('proj.weight', 'proj_with_mqa.weight', 'wq_b.weight', 'wk.weight')
YARN = {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0, 'original_max_position_embeddings': 64,
        'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0}


def dsa_shape(**overrides) -> dict:
    """A tiny DSA model's config fields: 3 layers (the first dense), 4 heads, 8 experts, an indexer of 32 heads of
    16 features keeping 8 tokens. With fewer heads many tokens score exactly 0 (no head's ReLU passes them), and
    transformers breaks the ties at the top-k boundary one way in prefill and another in decode."""
    shape = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                 num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=KV_LORA_RANK, q_lora_rank=48,
                 qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
                 index_topk=TOP_K, index_head_dim=INDEX_DIM, index_n_heads=32, vocab_size=VOCAB_SIZE,
                 max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=None, rope_parameters=YARN)
    return shape | overrides


@pytest.fixture(scope='module')
def deepseek_v32(tmp_path_factory) -> str:
    return save_random_model(DeepseekV32Config(**dsa_shape()), str(tmp_path_factory.mktemp('v32')),
                             std={'e_score_correction_bias': 0.1})


def test_greedy_and_first_logits_match_transformers(deepseek_v32):
    # every prompt but the first is longer than index_topk; 90 + 32 tokens pass YaRN's original 64 positions
    assert_matches_transformers(deepseek_v32, hf_causal_lm(deepseek_v32), random_prompts([5, 17, 40, 90]),
                                random_prompts([7, 31, 60]))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(deepseek_v32):
    """Chunks of 16 tokens and prefix hits of 64 tokens reuse the cached indexer keys of earlier chunks."""
    assert_batched_chunked_and_cached_equal_solo(deepseek_v32, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(deepseek_v32):
    """The heads and experts split over two ranks; each rank runs the whole indexer and selects the same tokens."""
    assert_tp2_equals_tp1(deepseek_v32, random_prompts([5, 40], seed=8))


def test_dense_attention_gives_other_tokens(deepseek_v32, monkeypatch):
    """The selection matters: with every causal key kept (the indexer bypassed) the tokens differ."""
    prompts = random_prompts([40, 60], seed=5)
    sparse = run(make_engine(deepseek_v32), prompts)
    monkeypatch.setattr(dsa, 'keep_top_k', lambda scores, causal, top_k: causal)
    assert run(make_engine(deepseek_v32), prompts) != sparse


def test_bf16_runs_with_bf16_indexer_keys(deepseek_v32):
    """bf16 on the CPU (packed projections, the fp32 ``weights_proj``): 32 tokens for each prompt, the indexer keys
    cached in bf16. Not compared with transformers: the tiny model's best scores lie closer at the top-k boundary
    (1e-4 relative) than bf16 resolves, so either side may select another token there."""
    engine = Engine(deepseek_v32, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    assert all(layer[-1].dtype == torch.bfloat16 for layer in engine.runner.kv_caches)
    assert [len(tokens) for tokens in run(engine, random_prompts([7, 40], seed=3))] == [32, 32]


def test_quantized_latent_beside_unquantized_indexer_keys(deepseek_v32):
    """``quant_policy`` 8 quantizes the latent (codes, then scales and zero points); the indexer keys stay fp32."""
    engine = make_engine(deepseek_v32, num_gpu_blocks=10, block_size=16, quant_policy=8)
    for layer_cache in engine.runner.kv_caches:
        assert [(tuple(t.shape), t.dtype) for t in layer_cache] == [
            ((11, 16, KV_LORA_RANK + ROPE_DIM), torch.uint8), ((11, 16, 2, 2), torch.float32),
            ((11, 16, INDEX_DIM), torch.float32)]
    assert [len(tokens) for tokens in run(engine, random_prompts([40, 60], seed=4))] == [32, 32]


def test_selection_breaks_ties_by_position():
    """Equal scores keep the earlier keys, however long the row (its masked tail included)."""
    scores = torch.tensor([0.0, 1.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0])
    for length in (6, 8):
        causal = torch.arange(8) < length
        assert dsa.keep_top_k(scores, causal, 3).nonzero().flatten().tolist() == [0, 1, 2]


def test_cache_holds_the_latent_and_the_indexer_key_per_token(deepseek_v32, caplog):
    """Each layer caches its latent and rotary key, then its indexer key, per token; the engine reports their
    bytes per token at start-up."""
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(deepseek_v32, num_gpu_blocks=10, block_size=16)
    for layer_cache in engine.runner.kv_caches:
        assert [tuple(t.shape) for t in layer_cache] == [(11, 16, KV_LORA_RANK + ROPE_DIM), (11, 16, INDEX_DIM)]
    per_token = 3 * (KV_LORA_RANK + ROPE_DIM + INDEX_DIM) * 4  # three layers, fp32
    assert engine.runner.cfg.kv_bytes_per_token() == per_token
    assert f'{per_token} bytes per token' in caplog.text and 'indexer keys (DSA)' in caplog.text


@pytest.mark.slow
def test_fp8_block_scaled_checkpoint_is_dequantized_at_load(deepseek_v32, tmp_path):
    """The hub's layout: the decoder's projections and the indexer's ``wq_b`` and ``wk`` in fp8 with block scales,
    its ``weights_proj`` not; the engine equals transformers on the same weights dequantized independently."""
    fp8_dir, dense_dir, quantized = save_fp8_and_dense(
        deepseek_v32, tmp_path, lambda name: (name.startswith('model.layers.') and name.endswith(FP8_WEIGHTS)
                                              and 'weights_proj' not in name))
    assert sum(name.endswith(('wq_b.weight_scale_inv', 'wk.weight_scale_inv')) for name in quantized) == 6
    prompts = random_prompts([5, 40], seed=11)
    assert_transformers_greedy(hf_causal_lm(str(dense_dir)), prompts, run(make_engine(str(fp8_dir)), prompts))
