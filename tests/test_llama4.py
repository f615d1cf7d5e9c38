"""Llama 4 (text) against transformers on tiny random models saved by transformers: chunked attention on the rope
layers (chunk 8, prompts far longer) with the L2 q/k norm, NoPE layers whose queries the temperature tuning scales
(floor_scale 4, so that it bites within the prompts), interleaved MoE layers (top-1 and top-2 sigmoid routers
scaling the experts' inputs, a shared expert) and dense layers; greedy tokens and first-step logits in fp32,
batching, chunked prefill, prefix-cache hits, sharded checkpoints and tensor parallelism. The chunked layers keep
their K/V in the sliding pool (window: the chunk), giving back the blocks before their chunks: at contexts of many
chunks the tokens of transformers and of the single pool that kept every block, with at most the rule's blocks."""
from __future__ import annotations

import logging

import pytest
import torch
from test_sliding_kv import abort_mid_decode_frees_both_pools, all_free, run_watching_blocks
from transformers import Llama4TextConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import assert_transformers_greedy, make_engine, random_prompts, run

from lmdeploy.messages import GenerationConfig

from lmdeploy.pytorch.models.llama4 import Llama4MoE
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.nn.rotary import query_temperature

CHUNK = 8
# hidden 64 and experts of 48 features: gate_up_proj [E, 64, 96] cannot be mistaken for its transpose
CONFIG = dict(hidden_size=64, intermediate_size=48, intermediate_size_mlp=80, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, num_local_experts=4,
              num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1],
              attention_chunk_size=CHUNK, floor_scale=4, attn_scale=0.5, max_position_embeddings=1024, tie_word_embeddings=False,
              rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0})


def save_llama4(path: str, max_shard_size: str = '50GB', **overrides) -> str:
    """A tiny random Llama 4 (``CONFIG`` with ``overrides``) saved with transformers."""
    config = Llama4TextConfig(**CONFIG | overrides)
    config.architectures = ['Llama4ForCausalLM']
    return save_random_model(config, path, max_shard_size)


@pytest.fixture(scope='module')
def model_path(tmp_path_factory) -> str:
    path = save_llama4(str(tmp_path_factory.mktemp('llama4')))
    config = Llama4TextConfig.from_pretrained(path)
    assert config.layer_types == ['chunked_attention', 'chunked_attention', 'full_attention', 'chunked_attention']
    assert config.moe_layers == [1, 3]
    return path


@pytest.fixture(scope='module')
def hf_model(model_path):
    return hf_causal_lm(model_path)


def test_greedy_and_first_logits_match_transformers(model_path, hf_model):
    assert_matches_transformers(model_path, hf_model, random_prompts([3, 17, 40, 75], seed=1),
                                random_prompts([7, 31, 60], seed=2))


def test_top2_router_and_sharded_checkpoint_match_transformers(tmp_path):
    """Two experts per token, each seeing the token scaled by its own score, the sum of their outputs; every layer
    a MoE one, without the q/k norm (as Maverick), llama3 rope scaling (as both); a checkpoint in many shards; the
    chunk (16) equal to the cache block; experts of 32 features, so that ``gate_up_proj [E, 64, 64]`` is square
    (its layout cannot be told from its shape)."""
    rope = {'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0, 'low_freq_factor': 1.0,
            'high_freq_factor': 4.0, 'original_max_position_embeddings': 32}
    path = save_llama4(str(tmp_path / 'top2'), num_experts_per_tok=2, attention_chunk_size=16, intermediate_size=32,
                       interleave_moe_layer_step=1, use_qk_norm=False, rope_parameters=rope, max_shard_size='100KB')
    assert len([p for p in (tmp_path / 'top2').iterdir() if p.suffix == '.safetensors']) > 1
    hf = hf_causal_lm(path)
    assert_matches_transformers(path, hf, random_prompts([5, 50], seed=7), random_prompts([45], seed=8))


def test_batched_chunked_and_cached_equal_solo(model_path):
    assert_batched_chunked_and_cached_equal_solo(model_path, prefix_sharing_prompts((50, 70), 32, (12, 21)),
                                                 chunked={'max_prefill_token_num': 8, 'block_size': 8})


def test_every_request_gives_back_its_blocks(model_path):
    engine = make_engine(model_path)
    run(engine, random_prompts([40, 9], seed=9))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_query_temperature_is_transformers_formula():
    positions = torch.arange(40)
    expected = torch.log1p(torch.floor((positions.float() + 1.0) / 4)) * 0.5 + 1.0
    assert torch.equal(query_temperature(positions, 4, 0.5, offset=1, log1p=True), expected)
    assert query_temperature(positions, 4, 0.5, offset=1, log1p=True)[:3].eq(1).all()


def test_layers_are_built_as_the_config_says(model_path):
    engine = make_engine(model_path)
    layers = engine.runner.model.layers
    assert [layer.self_attn.attn.attention_chunk for layer in layers] == [CHUNK, CHUNK, None, CHUNK]
    assert [isinstance(layer.mlp, Llama4MoE) for layer in layers] == [False, True, False, True]
    assert [layer.self_attn.scaled_queries for layer in layers] == [False, False, True, False]


def test_tp2_equals_tp1(model_path):
    assert_tp2_equals_tp1(model_path, random_prompts([5, 30], seed=6))


# blocks of 4 (half a chunk) and prefill chunks of 16: contexts of up to 14 attention chunks
POOLED = dict(block_size=4, max_prefill_token_num=16, max_batch_size=4)
LONG = GenerationConfig(max_new_tokens=40, ignore_eos=True)


def test_chunked_layers_keep_their_blocks_in_the_sliding_pool(model_path, caplog):
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(model_path, num_gpu_blocks=64, **POOLED)
    full, sliding = engine.block_manager.pools
    assert (full.window, sliding.window) == (None, CHUNK)
    assert (full.num_blocks, sliding.num_blocks) == (64, 4 * (2 + 1) + 4)
    caches = [layer[0].shape[0] for layer in engine.runner.kv_caches]
    assert caches == [sliding.num_blocks + 1, sliding.num_blocks + 1, 65, sliding.num_blocks + 1]
    assert f'{sliding.num_blocks} blocks for the chunked-attention layers (window {CHUNK})' in caplog.text


def test_long_contexts_match_transformers_and_the_pool_that_kept_every_block(model_path, hf_model, monkeypatch):
    """Batched, in chunks of 16 over blocks of 4: transformers' tokens, each prompt's tokens alone, and those of
    the engine before (one pool for every layer, no block given back); a sequence holds at most the rule's blocks
    of the sliding pool, ``ceil((C - 1 + 16) / 4) + 1``, while the full pool's grow with the context."""
    prompts = random_prompts([50, 75, 113], seed=11)
    outs, most_sliding, most_full = run_watching_blocks(make_engine(model_path, **POOLED), prompts, LONG)
    assert_transformers_greedy(hf_model, prompts, outs, 40)
    assert [run(make_engine(model_path, **POOLED), [p], LONG)[0] for p in prompts] == outs
    assert most_sliding <= -(-(CHUNK - 1 + 16) // 4) + 1 and most_full >= (113 + 39) // 4
    monkeypatch.setattr(PagedAttention, 'kv_window', property(lambda self: self.sliding_window))
    kept = make_engine(model_path, **POOLED)
    assert len(kept.block_manager.pools) == 1
    assert run(kept, prompts, LONG) == outs


def test_preempted_and_aborted_sequences_give_back_both_pools(model_path):
    """A cache of 40 blocks for the full layers preempts; recomputed, the tokens are those of a roomy cache; an
    abort mid-decode, after the sliding pool gave blocks back, leaves every block of both pools free."""
    prompts = random_prompts([60, 45, 70, 30], seed=12)
    roomy = run(make_engine(model_path, enable_prefix_caching=False, **POOLED), prompts, LONG)
    engine = make_engine(model_path, num_gpu_blocks=40, **POOLED)
    assert run(engine, prompts, LONG) == roomy
    assert engine.scheduler.num_preemptions > 0 and all_free(engine)
    abort_mid_decode_frees_both_pools(engine, prompts[:2], LONG, steps=12)
