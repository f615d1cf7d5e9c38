"""DeepSeek-V4 against transformers on a tiny random model with every layer kind: a sliding-window layer, two CSA
layers (windows of 4, an indexer keeping 4 entries) and an HCA layer (windows of 8), the first two routed by the
token table (``hash_moe``), the others by top-k; a window of 16 keys, well below the test contexts. Greedy tokens
and first-step logits in fp32, batching, chunked prefill (chunks ending inside windows), prefix-cache hits,
preemption, the cache's row per token, that the indexer's selection and the hash routing matter, and FP8 files."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_bf16_within_twice_transformers,
                           assert_matches_transformers, hf_causal_lm, prefix_sharing_prompts)
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_deepseek import save_fp8_and_dense

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.models.deepseek_v4_attention import Indexer

HEAD_DIM, INDEX_DIM, EXPERTS, TOP_K = 32, 16, 8, 2
LAYER_TYPES = ['sliding_attention', 'compressed_sparse_attention', 'heavily_compressed_attention',
               'compressed_sparse_attention']
YARN = {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32, 'beta_fast': 32.0,
        'beta_slow': 1.0}
FP8_WEIGHTS = ('wq_a.weight', 'wq_b.weight', 'wkv.weight', 'wo_a.weight', 'wo_b.weight', 'w1.weight', 'w2.weight',
               'w3.weight')


def v4_config(**overrides) -> DeepseekV4Config:
    """4 layers of hidden 64, 4 query heads of 32 features (8 rotary), 3 streams, 8 experts (2 a token), an indexer
    of 8 heads (with fewer, many entries score exactly 0 and the top-k's ties fall either way); the compressed
    layers turn by YaRN past 32 positions (as the hub's configs: ``compress`` rope only), the sliding one plainly."""
    shape = dict(vocab_size=VOCAB_SIZE, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=HEAD_DIM, q_lora_rank=48,
                 partial_rotary_factor=0.25, num_experts_per_tok=TOP_K, n_routed_experts=EXPERTS, n_shared_experts=1,
                 hc_mult=3, layer_types=LAYER_TYPES, mlp_layer_types=['hash_moe', 'hash_moe', 'moe', 'moe'],
                 compress_rates={'compressed_sparse_attention': 4, 'heavily_compressed_attention': 8},
                 sliding_window=16, o_groups=2, o_lora_rank=24, index_n_heads=8, index_head_dim=INDEX_DIM,
                 index_topk=4, max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=None,
                 rope_parameters=YARN)
    return DeepseekV4Config(**(shape | overrides))


def save_v4_model(path: str) -> str:
    """:func:`save_random_model`, its hash layers' ``tid2eid`` (zeros in a fresh model) drawn at random: distinct
    experts per token."""
    save_random_model(v4_config(), path, std={'e_score_correction_bias': 0.1})
    file = os.path.join(path, 'model.safetensors')
    weights = load_file(file)
    g = torch.Generator().manual_seed(1)
    for name in weights:
        if name.endswith('tid2eid'):
            weights[name] = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(VOCAB_SIZE)])
    save_file(weights, file, metadata={'format': 'pt'})
    return path


@pytest.fixture(scope='module')
def deepseek_v4(tmp_path_factory) -> str:
    return save_v4_model(str(tmp_path_factory.mktemp('v4')))


def test_greedy_and_first_logits_match_transformers(deepseek_v4):
    # 90 + 32 tokens: 7 windows of 16 keys, 30 CSA entries (the indexer keeps 4), 15 HCA entries
    assert_matches_transformers(deepseek_v4, hf_causal_lm(deepseek_v4), random_prompts([5, 17, 40, 90]),
                                random_prompts([7, 31, 60]))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(deepseek_v4):
    """Chunks of 13 tokens end inside CSA and HCA windows (an entry pools tokens of two chunks); prefix hits of 32
    tokens read the cached rows: every row is a function of the tokens up to its own, so hits are exact."""
    prompts = prefix_sharing_prompts(lengths=(50, 70), prefix=32, tails=(12,))
    assert_batched_chunked_and_cached_equal_solo(deepseek_v4, prompts,
                                                 chunked={'max_prefill_token_num': 13, 'block_size': 8})


@pytest.mark.slow
def test_preempted_equals_solo(deepseek_v4):
    prompts = random_prompts([50, 60, 70], seed=2)  # 276 tokens with their outputs, 224 in the cache
    plain = run(make_engine(deepseek_v4), prompts)
    tight = make_engine(deepseek_v4, num_gpu_blocks=14, enable_prefix_caching=False)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 14


def test_selection_and_hash_routing_matter(deepseek_v4, monkeypatch):
    """The indexer's top-k and the token table change the tokens (8 of them): every entry kept, or every token
    routed to experts 0 and 1 in the hash layers, the tokens differ."""
    prompts, gen = random_prompts([40, 60], seed=5), GenerationConfig(max_new_tokens=8, ignore_eos=True)
    engine = make_engine(deepseek_v4)
    sparse = run(engine, prompts, gen)
    with monkeypatch.context() as patch:
        patch.setattr(Indexer, 'select', lambda self, q, weights, keys, valid: (
            torch.arange(valid.shape[1]).expand_as(valid), valid))
        assert run(engine, prompts, gen) != sparse
    for layer in engine.runner.model.layers[:2]:
        layer.ffn.gate.tid2eid.copy_(torch.tensor([0, 1]).expand(VOCAB_SIZE, -1))
    assert run(engine, prompts, gen) != sparse


def test_cache_is_one_row_per_token(deepseek_v4, caplog):
    """Every layer caches one row a token: key-value (32), then CSA's compressor inputs (4 x 32) and entry (32),
    then its indexer's inputs (4 x 16) and entry (16), as the start-up log says; quant_policy is refused, as tensor
    parallelism."""
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(deepseek_v4, num_gpu_blocks=10, block_size=16)
    width = HEAD_DIM + 5 * HEAD_DIM + 5 * INDEX_DIM
    for layer_cache in engine.runner.kv_caches:
        assert [tuple(t.shape) for t in layer_cache] == [(11, 16, width)]
    per_token = 4 * width * 4  # four layers, fp32
    assert engine.runner.cfg.kv_bytes_per_token() == per_token
    assert 'float32 rows (compressed attention)' in caplog.text and f'{per_token} bytes per token' in caplog.text
    with pytest.raises(ValueError, match='quant_policy=0'):
        make_engine(deepseek_v4, quant_policy=8)
    with pytest.raises(ValueError, match='compressors are not sharded for tensor parallelism; use tp=1'):
        make_engine(deepseek_v4, tp=2)


@pytest.mark.slow
def test_fp8_block_scaled_checkpoint_is_dequantized_at_load(deepseek_v4, tmp_path):
    """The hub's layout: the attention's and experts' projections in fp8 with block scales, the compressors' and
    indexers' not; the engine equals transformers on the same weights dequantized independently."""
    fp8_dir, dense_dir, _ = save_fp8_and_dense(
        deepseek_v4, tmp_path, lambda name: (name.endswith(FP8_WEIGHTS) and '.compressor.' not in name
                                             and '.indexer.' not in name))
    prompts = random_prompts([5, 40], seed=11)
    assert_transformers_greedy(hf_causal_lm(str(dense_dir)), prompts, run(make_engine(str(fp8_dir)), prompts))


def test_bf16_within_twice_transformers(deepseek_v4):
    """bf16 on the CPU (packed projections; fp32 norms, hyper-connections, sinks and position biases): one prefill
    step's logits are within twice transformers' own bf16 error."""
    assert_bf16_within_twice_transformers(deepseek_v4)
