"""Arcee Trinity (``AfmoeForCausalLM``) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32 (gated attention, rotary only on the local sliding-window layers, per-head q/k
norms, norms before and after attention and MLP, muP's embedding scale, the sigmoid router with its expert bias,
``route_scale`` and shared experts, a dense first layer), batching, chunked prefill and prefix-cache hits, and
tensor parallelism."""
from __future__ import annotations

import pytest
from transformers import AfmoeConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_bf16_within_twice_transformers,
                           assert_correction_bias_loaded_and_routing, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts

WINDOW = 24


def afmoe_config(**overrides) -> AfmoeConfig:
    """Four query heads and two key/value heads of 16 features over a hidden size of 64; three layers, the first
    dense, local (window 24) and global by a step of 2; 8 experts, top 2, a shared expert, scaled by 2.5; muP on."""
    fields = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  num_shared_experts=1, num_dense_layers=1, global_attn_every_n_layers=2, sliding_window=WINDOW,
                  route_scale=2.5, mup_enabled=True, vocab_size=VOCAB_SIZE, max_position_embeddings=1024)
    return AfmoeConfig(**(fields | overrides))


@pytest.fixture(scope='module')
def afmoe(tmp_path_factory) -> str:
    """The routers' expert biases random, large enough to change choices."""
    return save_random_model(afmoe_config(), str(tmp_path_factory.mktemp('afmoe')), std={'expert_bias': 0.3})


def test_config_alternates_local_and_global_layers():
    assert afmoe_config().layer_types == ['sliding_attention', 'full_attention', 'sliding_attention']


def test_greedy_and_first_logits_match_transformers(afmoe):
    """Prompts shorter and longer than the window."""
    assert_matches_transformers(afmoe, hf_causal_lm(afmoe), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_expert_bias_is_loaded_and_routes(afmoe):
    """The checkpoint's ``mlp.expert_bias`` reaches each router and changes the tokens."""
    assert_correction_bias_loaded_and_routing(afmoe, 'mlp.expert_bias')


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(afmoe):
    assert_batched_chunked_and_cached_equal_solo(afmoe, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(afmoe):
    """Each rank computes its heads, their gates (``gate_proj`` split with them) and its share of every expert."""
    assert_tp2_equals_tp1(afmoe, random_prompts([5, 40], seed=8), logits=True)


def test_bf16_within_twice_transformers(afmoe, native_gemms):
    """bf16 on the native GEMMs, outside the native decoder stack (its gated attention and post-MLP norms are no
    option of the stack): logits within twice transformers' own bf16 error."""
    assert_bf16_within_twice_transformers(afmoe)
