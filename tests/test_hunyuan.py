"""Hunyuan-A13B (``HunYuanMoEV1ForCausalLM``) against transformers on tiny random models saved by transformers:
greedy tokens and first-step logits in fp32 (q/k norms after the rotary, NTK-alpha rope, the fp32 softmax router,
the shared MLP), batching, chunked prefill and prefix-cache hits, tensor parallelism, and bf16 on the CPU (in the
native decoder stack, with the tokens of the layers' own forward)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.models.hunyuan_v1_moe import HunYuanMoEV1Config
from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1RotaryEmbedding

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_first_logits_close,
                           assert_matches_transformers, assert_native_stack_gives_the_layers_tokens,
                           assert_tp2_equals_tp1, hf_causal_lm, hf_last_logits, prefix_sharing_prompts)
from helpers import random_prompts

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding

# Hunyuan-A13B's rope: dynamic with an alpha of 1000 (and a factor of 1, which transformers requires)
NTK_ALPHA = {'rope_type': 'dynamic', 'alpha': 1000.0, 'factor': 1.0, 'rope_theta': 10000.0}


def hunyuan_config(**overrides) -> HunYuanMoEV1Config:
    """Four query heads and two key/value heads of 16 features over a hidden size of 64; two layers of 8 experts,
    top 2, and a shared MLP."""
    fields = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=8, moe_topk=2, vocab_size=VOCAB_SIZE,
                  max_position_embeddings=1024, rope_parameters=NTK_ALPHA, pad_token_id=None)
    return HunYuanMoEV1Config(**(fields | overrides))


@pytest.fixture(scope='module')
def hunyuan(tmp_path_factory) -> str:
    return save_random_model(hunyuan_config(), str(tmp_path_factory.mktemp('hunyuan')))


def test_ntk_alpha_rope_is_transformers(hunyuan):
    """The rope's frequencies are transformers' NTK-alpha ones (a base 1000 ** (16 / 14) times larger), not the
    plain base's that a ``dynamic`` rope without its alpha would give at these lengths."""
    config = AutoConfig.from_pretrained(hunyuan)
    ours = RotaryEmbedding(config, config.head_dim).inv_freq
    torch.testing.assert_close(ours, HunYuanMoEV1RotaryEmbedding(config).inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, 1.0 / (10000.0**(torch.arange(0, 16, 2).float() / 16)))


def test_greedy_and_first_logits_match_transformers(hunyuan):
    assert_matches_transformers(hunyuan, hf_causal_lm(hunyuan), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(hunyuan):
    assert_batched_chunked_and_cached_equal_solo(hunyuan, prefix_sharing_prompts())


def test_tp2_equals_tp1(hunyuan):
    """Each rank computes its own heads (their norms per head) and its share of every expert and of the shared
    MLP."""
    assert_tp2_equals_tp1(hunyuan, random_prompts([5, 40], seed=8))


def test_bf16_close_to_transformers(hunyuan, native_gemms):
    """bf16 on the native GEMMs: the layers run in the native decoder stack (``qk_norm_after_rope``, the MoE layers
    as ``MoEBlock``s), within bf16's error of transformers in fp32."""
    engine = Engine(hunyuan, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    assert engine.runner.model.native_stack is not None
    hf_model = hf_causal_lm(hunyuan)
    prompts = random_prompts([7, 31, 60], seed=2)
    assert_first_logits_close(engine, prompts, [hf_last_logits(hf_model, p) for p in prompts], tol=0.05,
                              relative=True)


def test_bf16_native_stack_gives_the_layers_tokens(hunyuan, native_gemms):
    assert_native_stack_gives_the_layers_tokens(hunyuan)
