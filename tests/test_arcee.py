"""Arcee (``ArceeForCausalLM``, AFM-4.5B) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32 (the ungated ReLU² MLP; YaRN as AFM-4.5B's config has it, or biases on the
projections), batching, chunked prefill and prefix-cache hits, tensor parallelism, and bf16 in the native decoder
stack."""
from __future__ import annotations

import pytest
from transformers import ArceeConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_native_stack_gives_the_layers_tokens, assert_tp2_equals_tp1, hf_causal_lm,
                           prefix_sharing_prompts)
from helpers import random_prompts

# name -> config overrides: AFM-4.5B's layout (YaRN, no biases) and one with attention and MLP biases
VARIANTS = {
    'afm_yarn': dict(rope_parameters={'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0,
                                      'original_max_position_embeddings': 32}),
    'biased': dict(attention_bias=True, mlp_bias=True),
}


def arcee_config(**overrides) -> ArceeConfig:
    """Two layers of four query heads and two KV heads of 16 features over a hidden size of 64."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                 tie_word_embeddings=False, pad_token_id=None)
    return ArceeConfig(**{**shape, **overrides})


def save_arcee(path: str, variant: str) -> str:
    return save_random_model(arcee_config(**VARIANTS[variant]), path)


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def arcee(request, tmp_path_factory) -> str:
    return save_arcee(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_config_is_arcees_layout():
    assert arcee_config().hidden_act == 'relu2'


def test_greedy_and_first_logits_match_transformers(arcee):
    assert_matches_transformers(arcee, hf_causal_lm(arcee), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(arcee):
    assert_batched_chunked_and_cached_equal_solo(arcee, prefix_sharing_prompts())


def test_bf16_native_stack_gives_the_layers_tokens(arcee, native_gemms):
    """bf16 on the native GEMMs: the layers run in the native decoder stack (``ungated_mlp`` ``relu2``), with the
    tokens of their own forward."""
    assert_native_stack_gives_the_layers_tokens(arcee)


def test_tp2_equals_tp1(tmp_path):
    """Each rank computes its own heads and its share of the intermediate features (the up projection's rows, the
    down projection's columns, and their biases)."""
    assert_tp2_equals_tp1(save_arcee(str(tmp_path / 'arcee'), 'biased'), random_prompts([5, 40], seed=8))
