"""Apertus (``ApertusForCausalLM``) against transformers on a tiny random model saved by transformers: greedy tokens
and first-step logits in fp32 (q/k norms per head, its renamed norms, the ungated xIELU MLP with each layer's own
random alpha_p/alpha_n, llama3 rope scaling as Apertus 8B's config has it), batching, chunked prefill and prefix-cache
hits, tensor parallelism, and bf16 in the native decoder stack close to transformers, with the layers' tokens."""
from __future__ import annotations

import pytest
from transformers import ApertusConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_first_logits_close,
                           assert_matches_transformers, assert_native_stack_gives_the_layers_tokens,
                           assert_tp2_equals_tp1, hf_causal_lm, hf_last_logits, prefix_sharing_prompts)
from helpers import random_prompts

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

LLAMA3_ROPE = {'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0, 'low_freq_factor': 1.0,
               'high_freq_factor': 4.0, 'original_max_position_embeddings': 32}


def apertus_config(**overrides) -> ApertusConfig:
    """Two layers of four query heads and two KV heads of 16 features over a hidden size of 64."""
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                  tie_word_embeddings=False, pad_token_id=None, rope_parameters=LLAMA3_ROPE)
    return ApertusConfig(**(fields | overrides))


@pytest.fixture(scope='module')
def apertus(tmp_path_factory) -> str:
    return save_random_model(apertus_config(), str(tmp_path_factory.mktemp('apertus')))


def test_config_is_apertus_layout():
    assert apertus_config().hidden_act == 'xielu'


def test_greedy_and_first_logits_match_transformers(apertus):
    assert_matches_transformers(apertus, hf_causal_lm(apertus), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(apertus):
    assert_batched_chunked_and_cached_equal_solo(apertus, prefix_sharing_prompts())


def test_bf16_close_to_transformers(apertus, native_gemms):
    """bf16 on the native GEMMs, in the native decoder stack (``ungated_mlp`` ``xielu``): the logits stay within
    bf16's error of transformers in fp32."""
    engine = Engine(apertus, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    assert engine.runner.model.native_stack is not None
    hf_model = hf_causal_lm(apertus)
    prompts = random_prompts([7, 31, 60], seed=2)
    assert_first_logits_close(engine, prompts, [hf_last_logits(hf_model, p) for p in prompts], tol=0.05,
                              relative=True)


def test_bf16_native_stack_gives_the_layers_tokens(apertus, native_gemms):
    assert_native_stack_gives_the_layers_tokens(apertus)


def test_tp2_equals_tp1(apertus):
    """Each rank computes its own heads and its share of the intermediate features; every rank holds the xIELU
    parameters."""
    assert_tp2_equals_tp1(apertus, random_prompts([5, 40], seed=8))
