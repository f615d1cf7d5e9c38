"""Laguna (``LagunaForCausalLM``) against transformers on tiny random models saved by transformers: greedy tokens and
first-step logits in fp32 (a layer's own number of query heads, per-head q/k norms, the softplus gate of the attention
output per head or per feature, a rope per layer type, the full layers' over half the features, sliding-window layers,
a dense first layer, then sigmoid routing with the correction bias, soft-capped router logits, the routed output
scaled, plus a shared expert) at prompts longer than the window, batching, chunked prefill and prefix-cache hits, and
tensor parallelism."""
from __future__ import annotations

import pytest
from transformers import LagunaConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_bf16_within_twice_transformers,
                           assert_correction_bias_loaded_and_routing, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts

WINDOW = 16


def laguna_config(**overrides) -> LagunaConfig:
    """Two KV heads of 16 features over a hidden size of 64; four layers (full, sliding, sliding, full; window 16) of
    4, 8, 4 and 8 query heads; a dense first layer, then 8 experts, top 2, scaled by 1.5, and a shared expert."""
    fields = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_attention_heads_per_layer=[4, 8, 4, 8], num_experts=8, num_experts_per_tok=2,
                  moe_routed_scaling_factor=1.5, sliding_window=WINDOW,
                  layer_types=['full_attention', 'sliding_attention', 'sliding_attention', 'full_attention'],
                  vocab_size=VOCAB_SIZE, max_position_embeddings=1024)
    return LagunaConfig(**(fields | overrides))


@pytest.fixture(scope='module')
def laguna(tmp_path_factory) -> str:
    """The routers' correction biases random, large enough to change choices (saved as the hub's
    ``mlp.experts.e_score_correction_bias``, the shared expert as ``mlp.shared_expert``)."""
    return save_random_model(laguna_config(), str(tmp_path_factory.mktemp('laguna')),
                             std={'e_score_correction_bias': 0.3})


def test_greedy_and_first_logits_match_transformers(laguna):
    """Prompts shorter and several times longer than the window."""
    assert_matches_transformers(laguna, hf_causal_lm(laguna), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_gate_per_feature_and_capped_router_match_transformers(tmp_path):
    """``gating='per-element'`` (one gate per head feature) and router logits soft-capped at 0.5."""
    path = save_random_model(laguna_config(gating='per-element', moe_router_logit_softcapping=0.5), str(tmp_path),
                             std={'e_score_correction_bias': 0.3})
    assert_matches_transformers(path, hf_causal_lm(path), random_prompts([9, 40], seed=1),
                                random_prompts([25], seed=2))


def test_correction_bias_is_loaded_and_routes(laguna):
    assert_correction_bias_loaded_and_routing(laguna, 'mlp.gate.e_score_correction_bias')


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(laguna):
    assert_batched_chunked_and_cached_equal_solo(laguna, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(laguna):
    """Each rank computes its share of every layer's query heads, their gates, its KV head and its share of every
    expert and of the shared expert."""
    assert_tp2_equals_tp1(laguna, random_prompts([5, 40], seed=8), logits=True)


def test_bf16_within_twice_transformers(laguna, native_gemms):
    """bf16 on the native GEMMs, outside the native decoder stack
    (its softplus-gated attention is no option of the stack): logits within twice transformers' own bf16 error."""
    assert_bf16_within_twice_transformers(laguna)
