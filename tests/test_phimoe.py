"""Phi-3.5-MoE / Phi-tiny-MoE (``PhimoeForCausalLM``) against transformers on tiny random models saved by
transformers: greedy tokens and first-step logits in fp32 (sparsemixer's top-2 routing, biased LayerNorms, q/k/v/o
and LM head biases, LongRoPE with its short and long cos/sin factors), batching, chunked prefill and prefix-cache
hits, and tensor parallelism."""
from __future__ import annotations

import pytest
import torch
from transformers import PhimoeConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts

from lmdeploy.pytorch.models.phimoe import sparsemixer_top2

ORIGINAL_MAX = 64
# transformers' PhiMoE turns every sequence by the short factors (only its cos/sin factor follows the length), the
# engine long ones by the long factors as Phi-3 does: equal factors here, distinct cos/sin factors
LONG_ROPE = {'rope_type': 'longrope', 'rope_theta': 10000.0, 'short_factor': [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0],
             'long_factor': [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0], 'short_mscale': 1.1, 'long_mscale': 1.3,
             'original_max_position_embeddings': ORIGINAL_MAX}


def phimoe_config(**overrides) -> PhimoeConfig:
    """Four query heads and two key/value heads of 16 features over a hidden size of 64; two layers of 4 experts."""
    fields = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                  attention_bias=True, lm_head_bias=True, rope_parameters=LONG_ROPE)
    return PhimoeConfig(**(fields | overrides))


@pytest.fixture(scope='module')
def phimoe(tmp_path_factory) -> str:
    return save_random_model(phimoe_config(), str(tmp_path_factory.mktemp('phimoe')))


def test_sparsemixer_is_not_softmax_top2():
    """Each weight is a softmax over the experts near the chosen one, not over all of them: three close scores
    and a far one give weights that a plain softmax top-2 does not."""
    logits = torch.tensor([[2.0, 1.99, 1.985, -3.0]])
    weights, ids = sparsemixer_top2(logits, 0.01)
    assert ids.tolist() == [[0, 1]]
    near_first = torch.softmax(logits[0, :3], dim=-1)[0]
    near_second = torch.softmax(logits[0, 1:3], dim=-1)[0]
    torch.testing.assert_close(weights[0], torch.stack([near_first, near_second]))
    assert not torch.allclose(weights, torch.softmax(logits, dim=-1)[:, :2])


def test_greedy_and_first_logits_match_transformers(phimoe):
    """Prompts that stay within ``original_max_position_embeddings`` and ones longer from the start (the long cos/sin
    factor)."""
    assert_matches_transformers(phimoe, hf_causal_lm(phimoe), random_prompts([3, 17, 30, 70, 100]),
                                random_prompts([7, 31, 90]))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(phimoe):
    assert_batched_chunked_and_cached_equal_solo(phimoe, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(phimoe):
    """Each rank computes its heads and its share of every expert; the LM head bias is added once."""
    assert_tp2_equals_tp1(phimoe, random_prompts([5, 40], seed=8), logits=True)
