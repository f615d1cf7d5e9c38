"""The dense Hunyuan models (``HunYuanDenseV1ForCausalLM``, Hunyuan 0.5B-7B) against transformers on a tiny random
model saved by transformers: greedy tokens and first-step logits in fp32 (q/k norms after the rotary, NTK-alpha rope,
Llama's MLP, tied embeddings as the small models have them), batching, chunked prefill and prefix-cache hits, tensor
parallelism, and bf16 on the CPU (in the native decoder stack, ``qk_norm_after_rope``)."""
from __future__ import annotations

import pytest
from transformers.models.hunyuan_v1_dense import HunYuanDenseV1Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_first_logits_close,
                           assert_matches_transformers, assert_tp2_equals_tp1, hf_causal_lm, hf_last_logits,
                           prefix_sharing_prompts)
from helpers import random_prompts
from test_hunyuan import NTK_ALPHA

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine


def hunyuan_dense_config(**overrides) -> HunYuanDenseV1Config:
    """Four query heads and two key/value heads of 16 features over a hidden size of 64, two layers, NTK-alpha rope
    and tied embeddings (Hunyuan 0.5B-4B's)."""
    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                  rope_parameters=NTK_ALPHA, tie_word_embeddings=True, pad_token_id=None)
    return HunYuanDenseV1Config(**(fields | overrides))


@pytest.fixture(scope='module')
def hunyuan_dense(tmp_path_factory) -> str:
    return save_random_model(hunyuan_dense_config(), str(tmp_path_factory.mktemp('hunyuan_dense')))


def test_greedy_and_first_logits_match_transformers(hunyuan_dense):
    assert_matches_transformers(hunyuan_dense, hf_causal_lm(hunyuan_dense), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(hunyuan_dense):
    assert_batched_chunked_and_cached_equal_solo(hunyuan_dense, prefix_sharing_prompts())


def test_tp2_equals_tp1(hunyuan_dense):
    """Each rank computes its own heads (their norms per head) and its share of the MLP."""
    assert_tp2_equals_tp1(hunyuan_dense, random_prompts([5, 40], seed=8))


def test_bf16_close_to_transformers(hunyuan_dense, native_gemms):
    """bf16 on the native GEMMs: the layers run in the native decoder stack, within bf16's error of transformers in
    fp32."""
    engine = Engine(hunyuan_dense, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    assert engine.runner.model.native_stack is not None
    hf_model = hf_causal_lm(hunyuan_dense)
    prompts = random_prompts([7, 31, 60], seed=2)
    assert_first_logits_close(engine, prompts, [hf_last_logits(hf_model, p) for p in prompts], tol=0.05,
                              relative=True)
