"""Granite 3 MoE (``GraniteMoeForCausalLM``: granite-3.x-1b-a400m, 3b-a800m) against transformers on a tiny random
model saved by transformers: greedy tokens and first-step logits in fp32 (Granite's four multipliers, the checkpoints'
stacked ``input_linear``/``output_linear`` experts and ``router.layer``, softmax over the top-k logits), batching,
chunked prefill and prefix-cache hits, tensor parallelism, and bf16 in the native decoder stack (``residual_scale``,
MoE blocks)."""
from __future__ import annotations

import pytest
from test_decoder_stack_moe import assert_two_moe_layers_in_the_stack
from transformers import GraniteMoeConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts


def granitemoe_config(**overrides) -> GraniteMoeConfig:
    """Two layers of four query heads and two KV heads of 16 features over a hidden size of 64, each a MoE of 4
    experts of 64 features, top 2; multipliers of granite-3.1-1b-a400m's magnitudes."""
    shape = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB_SIZE,
                 max_position_embeddings=1024, embedding_multiplier=12.0, attention_multiplier=0.1,
                 residual_multiplier=0.22, logits_scaling=6.0, tie_word_embeddings=True, pad_token_id=None)
    return GraniteMoeConfig(**{**shape, **overrides})


@pytest.fixture(scope='module')
def granitemoe(tmp_path_factory) -> str:
    return save_random_model(granitemoe_config(), str(tmp_path_factory.mktemp('granitemoe')))


def test_greedy_and_first_logits_match_transformers(granitemoe):
    assert_matches_transformers(granitemoe, hf_causal_lm(granitemoe), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(granitemoe):
    assert_batched_chunked_and_cached_equal_solo(granitemoe, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(granitemoe):
    """Each rank computes its own heads and its share of every expert's features."""
    assert_tp2_equals_tp1(granitemoe, random_prompts([5, 40], seed=8))


def test_bf16_native_stack_equals_the_layers(granitemoe, native_gemms, monkeypatch):
    """bf16 on the native GEMMs: every layer in the stack (outputs scaled by ``residual_multiplier``, the MoE layers as
    ``MoEBlock``s), equal to the layers' forward at every step."""
    assert_two_moe_layers_in_the_stack(granitemoe, monkeypatch)
