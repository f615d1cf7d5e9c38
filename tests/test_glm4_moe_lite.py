"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``) against transformers on tiny random models saved by transformers:
greedy tokens and first-step logits in fp32, batching, chunked prefill and prefix-cache hits, the latent KV
cache, the next-token-prediction layer left unused, tensor parallelism, and bf16 in the native decoder stack."""
from __future__ import annotations

import pytest
from transformers import Glm4MoeLiteConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_native_stack_gives_the_layers_tokens, assert_tp2_equals_tp1, hf_causal_lm,
                           prefix_sharing_prompts)
from helpers import make_engine, random_prompts
from test_glm4_moe import assert_mtp_layer_is_skipped

from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3MoE
from lmdeploy.pytorch.models.llama import LlamaMLP

KV_LORA_RANK, ROPE_DIM = 32, 8
# name -> config overrides: GLM-4.7-Flash's shape (interleaved rotary pairs, one expert group, scaled weights,
# dense then sparse layers), and halves rotary with two groups and a dense layer between sparse ones
VARIANTS = {
    'flash': dict(routed_scaling_factor=1.8),
    'halves_two_groups': dict(rope_interleave=False, n_group=2, topk_group=1, routed_scaling_factor=1.0,
                              mlp_layer_types=['sparse', 'dense', 'sparse']),
}


def glm4_moe_lite_config(**overrides) -> Glm4MoeLiteConfig:
    """Four heads over a latent of 32 (GLM-4.7-Flash: 20 heads, 512) with a query projection of rank 48; three
    layers, the sparse ones of 8 experts (top 2) and a shared expert."""
    return Glm4MoeLiteConfig(**{**dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=KV_LORA_RANK, q_lora_rank=48,
        qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=16, v_head_dim=16, vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024, pad_token_id=None), **overrides})


def save_glm4_moe_lite(path: str, **overrides) -> str:
    """A tiny random GLM-4.7-Flash saved with transformers; the routers' correction biases are random too."""
    return save_random_model(glm4_moe_lite_config(**overrides), path, std={'e_score_correction_bias': 0.1})


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def glm4_moe_lite(request, tmp_path_factory) -> str:
    return save_glm4_moe_lite(str(tmp_path_factory.mktemp(request.param)), **VARIANTS[request.param])


def test_greedy_and_first_logits_match_transformers(glm4_moe_lite):
    assert_matches_transformers(glm4_moe_lite, hf_causal_lm(glm4_moe_lite), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(tmp_path):
    """On GLM-4.7-Flash's shape only (the other variant's layers batch alike): a minute on two loaded cores."""
    path = save_glm4_moe_lite(str(tmp_path / 'flash'), **VARIANTS['flash'])
    assert_batched_chunked_and_cached_equal_solo(path, prefix_sharing_prompts())


def test_layers_follow_mlp_layer_types_over_a_latent_cache(glm4_moe_lite):
    """Each layer is dense or sparse as ``mlp_layer_types`` says, and the cache holds one latent per token."""
    engine = make_engine(glm4_moe_lite)
    hf = engine.runner.model.cfg.hf_config
    kinds = [type(layer.mlp) for layer in engine.runner.model.layers]
    assert kinds == [DeepseekV3MoE if kind == 'sparse' else LlamaMLP for kind in hf.mlp_layer_types]
    assert engine.runner.kv_caches[0][0].shape[-1] == KV_LORA_RANK + ROPE_DIM


def test_bf16_native_stack_gives_the_layers_tokens(glm4_moe_lite, native_gemms):
    """bf16 on the native GEMMs: every layer runs in the native decoder stack (latent attention, the MoE layers as
    ``MoEBlock``s routed ``noaux_tc``), with the tokens of the layers' own forward."""
    assert_native_stack_gives_the_layers_tokens(glm4_moe_lite)


def test_tp2_equals_tp1(tmp_path):
    """Each rank computes its own heads (their share of ``q_b_proj`` and ``kv_b_proj``) and its share of every
    expert and of the shared expert."""
    assert_tp2_equals_tp1(save_glm4_moe_lite(str(tmp_path / 'flash'), **VARIANTS['flash']),
                          random_prompts([5, 40], seed=8))


def test_next_token_prediction_layer_is_not_loaded(tmp_path):
    """GLM-4.7-Flash's files carry an MTP layer past ``num_hidden_layers`` (transformers ignores ``layers.47``):
    the engine skips it."""
    assert_mtp_layer_is_skipped(save_glm4_moe_lite(str(tmp_path / 'flash'), **VARIANTS['flash']), 64)
