"""Llama 4 (text) against transformers on tiny random models saved by transformers: chunked attention on the rope
layers (chunk 8, prompts far longer) with the L2 q/k norm, NoPE layers whose queries the temperature tuning scales
(floor_scale 4, so that it bites within the prompts), interleaved MoE layers (top-1 and top-2 sigmoid routers
scaling the experts' inputs, a shared expert) and dense layers; greedy tokens and first-step logits in fp32,
batching, chunked prefill, prefix-cache hits, sharded checkpoints and tensor parallelism."""
from __future__ import annotations

import pytest
import torch
from transformers import Llama4TextConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import make_engine, random_prompts, run

from lmdeploy.pytorch.models.llama4 import Llama4MoE
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
    chunk (16) equal to the cache block."""
    rope = {'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0, 'low_freq_factor': 1.0,
            'high_freq_factor': 4.0, 'original_max_position_embeddings': 32}
    path = save_llama4(str(tmp_path / 'top2'), num_experts_per_tok=2, attention_chunk_size=16,
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
    assert torch.equal(query_temperature(positions, 4, 0.5, offset=1), expected)
    assert query_temperature(positions, 4, 0.5, offset=1)[:3].eq(1).all()


def test_layers_are_built_as_the_config_says(model_path):
    engine = make_engine(model_path)
    layers = engine.runner.model.layers
    assert [layer.self_attn.attn.attention_chunk for layer in layers] == [CHUNK, CHUNK, None, CHUNK]
    assert [isinstance(layer.mlp, Llama4MoE) for layer in layers] == [False, True, False, True]
    assert [layer.self_attn.scaled_queries for layer in layers] == [False, False, True, False]


def test_tp2_equals_tp1(model_path):
    assert_tp2_equals_tp1(model_path, random_prompts([5, 30], seed=6))
