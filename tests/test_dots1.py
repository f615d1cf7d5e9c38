"""dots.llm1 (``Dots1ForCausalLM``) against transformers on tiny random models saved by transformers: greedy tokens
and first-step logits in fp32 (per-head q/k norms, a sliding-window layer, the fp32 sigmoid router with its
correction bias and scaling, shared experts, a dense first layer), batching, chunked prefill and prefix-cache hits,
tensor parallelism and bf16 in the native decoder stack."""
from __future__ import annotations

import pytest
from transformers import Dots1Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_correction_bias_loaded_and_routing,
                           assert_matches_transformers, assert_native_stack_gives_the_layers_tokens,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts

WINDOW = 24


def dots1_config(**overrides) -> Dots1Config:
    """Four query heads and two key/value heads of 16 features over a hidden size of 64; three layers, the first
    dense, the second attending over a window of 24 tokens; 8 experts, top 2, two shared experts; dots.llm1's
    routing (one group, renormalized, scaled by 2.5)."""
    fields = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=2.5, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                  sliding_window=WINDOW, layer_types=['full_attention', 'sliding_attention', 'full_attention'])
    return Dots1Config(**(fields | overrides))


@pytest.fixture(scope='module')
def dots1(tmp_path_factory) -> str:
    """The routers' correction biases random, large enough to change choices."""
    return save_random_model(dots1_config(), str(tmp_path_factory.mktemp('dots1')),
                             std={'e_score_correction_bias': 0.3})


def test_greedy_and_first_logits_match_transformers(dots1):
    """Prompts shorter and longer than the window."""
    assert_matches_transformers(dots1, hf_causal_lm(dots1), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_correction_bias_routes(dots1):
    """The checkpoint's correction biases reach the routers and change the tokens."""
    assert_correction_bias_loaded_and_routing(dots1, 'mlp.gate.e_score_correction_bias')


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(dots1):
    assert_batched_chunked_and_cached_equal_solo(dots1, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(dots1):
    """Each rank computes its heads (their norms per head) and its share of every expert and shared expert."""
    assert_tp2_equals_tp1(dots1, random_prompts([5, 40], seed=8), logits=True)


def test_bf16_native_stack_gives_the_layers_tokens(dots1, native_gemms):
    """bf16 on the native GEMMs: every layer in the native decoder stack (per-head q/k norms, the window, the MoE
    layers as ``MoEBlock``s routed ``noaux_tc``), with the tokens of the layers' own forward."""
    assert_native_stack_gives_the_layers_tokens(dots1)
