"""EXAONE 4.0 (``Exaone4ForCausalLM``) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32 (the 32B's layout: sliding-window layers with rotary and full NoPE layers,
windows narrower than most prompts; the 1.2B's: full layers with rotary and tied embeddings), batching, chunked
prefill and prefix-cache hits, tensor parallelism, and bf16 in the native decoder stack."""
from __future__ import annotations

import pytest
from transformers import Exaone4Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_native_stack_gives_the_layers_tokens, assert_tp2_equals_tp1, hf_causal_lm,
                           prefix_sharing_prompts)
from helpers import random_prompts

# name -> config overrides: EXAONE-4.0-32B's layout (3 sliding layers with rotary, then a full NoPE one) and
# EXAONE-4.0-1.2B's (no window: full layers with rotary, llama3 rope scaling, tied embeddings)
VARIANTS = {
    'exaone4_32b': dict(sliding_window=16, layer_types=['sliding_attention'] * 3 + ['full_attention'],
                        tie_word_embeddings=False),
    'exaone4_1_2b': dict(sliding_window=None, layer_types=['full_attention'] * 4, tie_word_embeddings=True,
                         rope_parameters={'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0,
                                          'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                          'original_max_position_embeddings': 128}),
}


def exaone4_config(**overrides) -> Exaone4Config:
    """Four layers of four query heads and two KV heads of 16 features over a hidden size of 64."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                 pad_token_id=None)
    return Exaone4Config(**{**shape, **overrides})


def save_exaone4(path: str, variant: str, **overrides) -> str:
    """A tiny random model of ``variant`` (its config changed by ``overrides``) saved with transformers."""
    return save_random_model(exaone4_config(**{**VARIANTS[variant], **overrides}), path)


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def exaone4(request, tmp_path_factory) -> str:
    return save_exaone4(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_config_is_exaone4s_layout():
    config = exaone4_config(**VARIANTS['exaone4_32b'])
    assert config.sliding_window == 16 and config.layer_types[3] == 'full_attention'
    assert exaone4_config(**VARIANTS['exaone4_1_2b']).sliding_window is None


def test_greedy_and_first_logits_match_transformers(exaone4):
    assert_matches_transformers(exaone4, hf_causal_lm(exaone4), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(exaone4):
    assert_batched_chunked_and_cached_equal_solo(exaone4, prefix_sharing_prompts())


def test_bf16_native_stack_gives_the_layers_tokens(exaone4, native_gemms):
    """bf16 on the native GEMMs: every layer runs in the native decoder stack (OLMo 2's ``post_norms_only`` with
    per-head q/k norms, no rotary in the NoPE layers), with the tokens of the layers' own forward."""
    assert_native_stack_gives_the_layers_tokens(exaone4)


def test_tp2_equals_tp1(tmp_path):
    """Each rank computes its own heads (their q/k norms are per head) and its share of the MLP."""
    assert_tp2_equals_tp1(save_exaone4(str(tmp_path / 'exaone4'), 'exaone4_32b'), random_prompts([5, 40], seed=8))
