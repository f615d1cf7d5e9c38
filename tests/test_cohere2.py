"""Cohere2 (``Cohere2ForCausalLM``: Command R7B, Command A) against transformers on tiny random models saved by
transformers: greedy tokens and first-step logits in fp32 (parallel blocks on one LayerNorm, sliding-window layers
turning neighbouring pairs, windows narrower than most prompts, full NoPE layers, scaled logits), batching, chunked
prefill and prefix-cache hits, and tensor parallelism."""
from __future__ import annotations

import pytest
from transformers import Cohere2Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts

# name -> config overrides: Command R7B's and Command A's layout (no biases, tied embeddings), and one with
# attention biases (q/k/v and o) and an LM head of its own
VARIANTS = {
    'command_r7b': dict(attention_bias=False, tie_word_embeddings=True),
    'biased_untied': dict(attention_bias=True, tie_word_embeddings=False),
}


def cohere2_config(**overrides) -> Cohere2Config:
    """Four layers (three sliding-window ones of 16 tokens, then a full one) of four query heads and two KV heads of
    16 features over a hidden size of 64; logits scaled by 0.25 (Command R7B's ``logit_scale``)."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=1024, sliding_window=16,
                 logit_scale=0.25, pad_token_id=None)
    return Cohere2Config(**{**shape, **overrides})


def save_cohere2(path: str, variant: str, **overrides) -> str:
    """A tiny random model of ``variant`` (its config changed by ``overrides``) saved with transformers."""
    return save_random_model(cohere2_config(**{**VARIANTS[variant], **overrides}), path)


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def cohere2(request, tmp_path_factory) -> str:
    return save_cohere2(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_config_is_cohere2s_layout():
    config = cohere2_config()
    assert config.layer_types == ['sliding_attention'] * 3 + ['full_attention']
    assert config.head_dim == 16


def test_greedy_and_first_logits_match_transformers(cohere2):
    assert_matches_transformers(cohere2, hf_causal_lm(cohere2), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(cohere2):
    assert_batched_chunked_and_cached_equal_solo(cohere2, prefix_sharing_prompts())


def test_tp2_equals_tp1(tmp_path):
    """Each rank computes its own heads and its share of the MLP; the parallel block adds both partial sums."""
    assert_tp2_equals_tp1(save_cohere2(str(tmp_path / 'cohere2'), 'biased_untied'), random_prompts([5, 40], seed=8))
