"""K-EXAONE (``ExaoneMoeForCausalLM``) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32 (per-head q/k norms, sliding-window layers with rotary beside full ones
without it, the fp32 sigmoid router with its correction bias and scaling, a shared expert, a dense first layer),
batching, chunked prefill and prefix-cache hits, tensor parallelism and bf16 in the native decoder stack."""
from __future__ import annotations

import pytest
from transformers import ExaoneMoeConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_correction_bias_loaded_and_routing,
                           assert_matches_transformers, assert_native_stack_gives_the_layers_tokens,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts

WINDOW = 24


def exaone_moe_config(**overrides) -> ExaoneMoeConfig:
    """Four query heads and two key/value heads of 16 features over a hidden size of 64; three layers, the first
    dense, sliding (window 24, rotary) and full (no rotary) by a pattern of 2; 8 experts, top 2, in 2 groups of which
    the best one is kept, a shared expert, scaled by 2.5."""
    fields = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  num_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, vocab_size=VOCAB_SIZE,
                  max_position_embeddings=1024, sliding_window=WINDOW, sliding_window_pattern=2, pad_token_id=None)
    return ExaoneMoeConfig(**(fields | overrides))


@pytest.fixture(scope='module')
def exaone_moe(tmp_path_factory) -> str:
    """The routers' correction biases random, large enough to change choices."""
    return save_random_model(exaone_moe_config(), str(tmp_path_factory.mktemp('exaone_moe')),
                             std={'e_score_correction_bias': 0.3})


def test_config_alternates_sliding_and_full_layers():
    config = exaone_moe_config()
    assert config.layer_types == ['sliding_attention', 'full_attention', 'sliding_attention']
    assert config.mlp_layer_types == ['dense', 'sparse', 'sparse']


def test_greedy_and_first_logits_match_transformers(exaone_moe):
    """Prompts shorter and longer than the window."""
    assert_matches_transformers(exaone_moe, hf_causal_lm(exaone_moe), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_correction_bias_is_loaded_and_routes(exaone_moe):
    """The checkpoint's ``mlp.e_score_correction_bias`` reaches each router and changes the tokens."""
    assert_correction_bias_loaded_and_routing(exaone_moe, 'mlp.gate.e_score_correction_bias')


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(exaone_moe):
    assert_batched_chunked_and_cached_equal_solo(exaone_moe, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(exaone_moe):
    """Each rank computes its heads (their norms per head) and its share of every expert and of the shared expert."""
    assert_tp2_equals_tp1(exaone_moe, random_prompts([5, 40], seed=8), logits=True)


def test_bf16_native_stack_gives_the_layers_tokens(exaone_moe, native_gemms):
    """bf16 on the native GEMMs: every layer in the native decoder stack (per-head q/k norms, windows, NoPE full
    layers, the MoE layers as ``MoEBlock``s routed ``noaux_tc``), with the tokens of the layers' own forward."""
    assert_native_stack_gives_the_layers_tokens(exaone_moe)
