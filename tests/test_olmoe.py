"""OLMoE (``OlmoeForCausalLM``) against transformers on tiny random models saved by transformers: greedy tokens and
first-step logits in fp32 (q/k norms over all heads; softmax routing with the top-k left unnormalized, as
OLMoE-1B-7B's ``norm_topk_prob`` false, or renormalized; ``clip_qkv``), batching, chunked prefill and prefix-cache
hits, tensor parallelism (the q/k norms over every rank's heads), and bf16 in the native decoder stack (``qk_norm_across_heads``, MoE blocks)."""
from __future__ import annotations

import pytest
from test_decoder_stack_moe import assert_two_moe_layers_in_the_stack
from transformers import OlmoeConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import random_prompts

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

# name -> config overrides: OLMoE-1B-7B's routing (top-k weights as the softmax gives them), and the top-k
# renormalized with queries, keys and values clamped
VARIANTS = {'unnormalized': dict(norm_topk_prob=False), 'clipped': dict(norm_topk_prob=True, clip_qkv=0.5)}


def olmoe_config(**overrides) -> OlmoeConfig:
    """Two layers of four query heads and two KV heads of 16 features over a hidden size of 64, each a MoE of 4
    experts of 32 features, top 2."""
    shape = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB_SIZE,
                 max_position_embeddings=1024, pad_token_id=None)
    return OlmoeConfig(**{**shape, **overrides})


def save_olmoe(path: str, variant: str) -> str:
    return save_random_model(olmoe_config(**VARIANTS[variant]), path)


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def olmoe(request, tmp_path_factory) -> str:
    return save_olmoe(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_config_is_olmoes_layout():
    config = olmoe_config()
    assert not config.norm_topk_prob and config.clip_qkv is None and not config.tie_word_embeddings


def test_greedy_and_first_logits_match_transformers(olmoe):
    assert_matches_transformers(olmoe, hf_causal_lm(olmoe), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(tmp_path):
    assert_batched_chunked_and_cached_equal_solo(save_olmoe(str(tmp_path / 'olmoe'), 'unnormalized'),
                                                 prefix_sharing_prompts())


def test_tp2_equals_tp1(tmp_path):
    """Each rank norms its heads' queries and keys by every rank's sums of squares (``norm_across_heads``), clamps
    them (``clip_qkv``) and computes its share of every expert: one rank's tokens and logits."""
    path = save_olmoe(str(tmp_path / 'olmoe'), 'clipped')
    assert_tp2_equals_tp1(path, random_prompts([5, 40], seed=8), logits=True)


@pytest.mark.slow
def test_bf16_native_stack_equals_the_layers(tmp_path, native_gemms, monkeypatch):
    """bf16 on the native GEMMs: every layer in the stack (q/k norms across heads, the MoE layers as ``MoEBlock``s
    routed by softmax, unnormalized), equal to the layers' forward at every step."""
    assert_two_moe_layers_in_the_stack(save_olmoe(str(tmp_path / 'olmoe'), 'unnormalized'), monkeypatch)


def test_clipped_layers_run_their_own_forward(tmp_path, native_gemms):
    """The stack does not clamp q/k/v: with ``clip_qkv`` set the layers run their own forward."""
    engine = Engine(save_olmoe(str(tmp_path / 'olmoe'), 'clipped'),
                    PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16), show_progress=False)
    assert engine.runner.model.native_stack is None
