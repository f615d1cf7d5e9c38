"""GraniteMoeShared (``GraniteMoeSharedForCausalLM``: Granite 3 MoE plus a gated-SiLU shared MLP added ungated to the
experts' output) against transformers on a tiny random model saved by transformers: greedy tokens and first-step
logits in fp32, batching, chunked prefill and prefix-cache hits, tensor parallelism, a config without a shared MLP
(``shared_intermediate_size`` 0), and bf16 in the native decoder stack (MoE blocks with shared experts)."""
from __future__ import annotations

import pytest
from test_decoder_stack_moe import assert_two_moe_layers_in_the_stack
from test_granitemoe import granitemoe_config
from transformers import GraniteMoeSharedConfig

from conftest import save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts


def granitemoeshared_config(**overrides) -> GraniteMoeSharedConfig:
    """:func:`test_granitemoe.granitemoe_config`'s shape and multipliers with a shared MLP of 96 features."""
    fields = granitemoe_config().to_dict() | {'shared_intermediate_size': 96, 'pad_token_id': None}
    for key in ('model_type', 'architectures', 'transformers_version'):
        fields.pop(key, None)
    return GraniteMoeSharedConfig(**{**fields, **overrides})


@pytest.fixture(scope='module')
def granitemoeshared(tmp_path_factory) -> str:
    return save_random_model(granitemoeshared_config(), str(tmp_path_factory.mktemp('granitemoeshared')))


def test_greedy_and_first_logits_match_transformers(granitemoeshared):
    assert_matches_transformers(granitemoeshared, hf_causal_lm(granitemoeshared), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


@pytest.mark.slow
def test_without_a_shared_mlp_matches_transformers(tmp_path):
    """``shared_intermediate_size`` 0: transformers builds no shared MLP, and the engine none either."""
    path = save_random_model(granitemoeshared_config(shared_intermediate_size=0), str(tmp_path))
    assert_matches_transformers(path, hf_causal_lm(path), random_prompts([9, 40]), random_prompts([12]))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(granitemoeshared):
    assert_batched_chunked_and_cached_equal_solo(granitemoeshared, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(granitemoeshared):
    """Each rank computes its own heads, its share of every expert's features and of the shared MLP's."""
    assert_tp2_equals_tp1(granitemoeshared, random_prompts([5, 40], seed=8))


def test_bf16_native_stack_equals_the_layers(granitemoeshared, native_gemms, monkeypatch):
    """bf16 on the native GEMMs: every layer in the stack, the MoE layers as ``MoEBlock``s with the shared MLP as
    their ungated shared experts, equal to the layers' forward at every step."""
    assert_two_moe_layers_in_the_stack(granitemoeshared, monkeypatch)
