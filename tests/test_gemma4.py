"""Gemma 4 (``Gemma4ForCausalLM``, and ``Gemma4ForConditionalGeneration`` read for its language model) against
transformers on tiny random models saved by transformers: the dense layout of E2B/E4B (per-layer inputs, KV-sharing
layers with a double-wide MLP, full-attention layers of wider heads on a proportional rope) and the MoE layout of
26B-A4B / the dense 31B (full layers with fewer KV heads whose values are their keys, a MoE block beside the MLP);
sliding windows narrower than most prompts; batching, chunked prefill and prefix-cache hits; text-only serving of the
multimodal checkpoint."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma4Config, Gemma4TextConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_bf16_within_twice_transformers,
                           assert_matches_transformers, hf_causal_lm, prefix_sharing_prompts)
from helpers import make_engine, random_prompts, run
from test_gemma3n import assert_images_and_audio_refused

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.engine.engine import Engine

SLIDING, FULL = 'sliding_attention', 'full_attention'
WINDOW = 16
# the hub's rope: the sliding layers' default one, the full layers' proportional one over a quarter of each half
ROPE = {SLIDING: {'rope_type': 'default', 'rope_theta': 10000.0},
        FULL: {'rope_type': 'proportional', 'partial_rotary_factor': 0.25, 'rope_theta': 1000000.0}}


def dense_config(**overrides) -> Gemma4TextConfig:
    """E2B's layout, shrunk: five layers (sliding, full, sliding, then a sliding and a full one sharing the KV of
    layers 2 and 1, with a double-wide MLP) of four query heads, two KV heads of 16 features in the sliding layers and
    of 32 in the full ones, over a hidden size of 64; per-layer inputs of 8 features; logits soft-capped at 30."""
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, global_head_dim=32, vocab_size=VOCAB_SIZE,
                 vocab_size_per_layer_input=VOCAB_SIZE, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                 use_double_wide_mlp=True, sliding_window=WINDOW, layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
                 rope_parameters=ROPE, final_logit_softcapping=30.0, max_position_embeddings=1024, pad_token_id=None)
    return Gemma4TextConfig(**{**shape, **overrides})


def moe_config(**overrides) -> Gemma4TextConfig:
    """26B-A4B's layout, shrunk: four layers (sliding, full, sliding, full) of four query heads over two KV heads of
    16 features, the full ones one KV head of 32 whose values are its keys; every layer a MLP of 96 and beside it
    4 experts of 32, 2 per token; no per-layer inputs nor KV sharing."""
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                 attention_k_eq_v=True, vocab_size=VOCAB_SIZE, hidden_size_per_layer_input=0,
                 enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                 sliding_window=WINDOW, layer_types=[SLIDING, FULL, SLIDING, FULL], rope_parameters=ROPE,
                 final_logit_softcapping=30.0, max_position_embeddings=1024, pad_token_id=None)
    return Gemma4TextConfig(**{**shape, **overrides})


# random layer scalars, router scales and per-expert scales, so that a model ignoring them gives other tokens
STD = {'layer_scalar': 0.5, 'router.scale': 1.0, 'per_expert_scale': 1.0}


@pytest.fixture(scope='module')
def gemma4(tmp_path_factory) -> str:
    return save_random_model(dense_config(), str(tmp_path_factory.mktemp('gemma4')), std=STD)


@pytest.fixture(scope='module')
def gemma4_moe(tmp_path_factory) -> str:
    return save_random_model(moe_config(), str(tmp_path_factory.mktemp('gemma4_moe')), std=STD)


@pytest.fixture(scope='module')
def gemma4_multimodal(gemma4, tmp_path_factory) -> str:
    """The dense tiny model as the hub lays out ``Gemma4ForConditionalGeneration``: its language model under
    ``model.language_model.``, beside vision and audio tower tensors."""
    path = tmp_path_factory.mktemp('gemma4_multimodal')
    for name in Path(gemma4).iterdir():
        if name.name not in ('config.json', 'model.safetensors'):
            shutil.copy(name, path)
    tensors = {name.replace('model.', 'model.language_model.', 1): tensor
               for name, tensor in load_file(f'{gemma4}/model.safetensors').items()}
    g = torch.Generator().manual_seed(5)
    for name in ('model.audio_tower.layers.0.self_attn.q_proj.linear.weight',
                 'model.embed_audio.embedding_projection.weight',
                 'model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight',
                 'model.embed_vision.embedding_projection.weight'):
        tensors[name] = torch.randn(32, 64, generator=g)
    save_file(tensors, f'{path}/model.safetensors', metadata={'format': 'pt'})
    text_config = json.loads(Path(gemma4, 'config.json').read_text())
    config = Gemma4Config(text_config=dense_config(eos_token_id=text_config['eos_token_id'],
                                                   bos_token_id=text_config['bos_token_id']).to_dict())
    config.architectures = ['Gemma4ForConditionalGeneration']
    config.save_pretrained(path)
    return str(path)


def test_cache_geometry_per_layer():
    """The full layers' caches are of their own heads; the KV-sharing layers hold none (bf16: 2 bytes a feature)."""
    config = dense_config()
    config.architectures = ['Gemma4ForCausalLM']
    cfg = ModelConfig.from_hf(config, torch.bfloat16)
    assert cfg.layer_kv_geometry == ((2, 16), (2, 32), (2, 16), (2, 16), (2, 32))
    assert cfg.kv_bytes_per_token() == 2 * 2 * (2 * 16 + 2 * 32 + 2 * 16)
    assert cfg.shared_kv_bytes_per_token() == 2 * 2 * (2 * 16 + 2 * 32)
    config = moe_config()
    config.architectures = ['Gemma4ForCausalLM']
    assert ModelConfig.from_hf(config, torch.bfloat16).layer_kv_geometry == ((2, 16), (1, 32)) * 2


def test_dense_matches_transformers(gemma4):
    """Prompts of 52 and 90 tokens run past the 16-token window."""
    assert_matches_transformers(gemma4, hf_causal_lm(gemma4), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60], vocab=VOCAB_SIZE))


def test_moe_matches_transformers(gemma4_moe):
    assert_matches_transformers(gemma4_moe, hf_causal_lm(gemma4_moe), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60], vocab=VOCAB_SIZE))


@pytest.mark.slow
@pytest.mark.parametrize('fixture', ['gemma4', 'gemma4_moe'])
def test_batched_chunked_and_cached_equal_solo(fixture, request):
    """Prompts of 40 to 50 tokens, past the window; two share the first's 32-token prefix."""
    assert_batched_chunked_and_cached_equal_solo(request.getfixturevalue(fixture),
                                                 prefix_sharing_prompts((40, 50), 32, (10, 12)))


def test_caches_of_each_layer_geometry(gemma4):
    """Each layer with keys and values of its own holds a cache of its heads; the two KV-sharing layers none."""
    caches = make_engine(gemma4).runner.kv_caches
    assert [tuple(cache[0].shape[1::2]) if cache else None for cache in caches] == [
        (2, 16), (2, 32), (2, 16), None, None]


def test_cache_fills_the_budget_by_each_layers_bytes(gemma4, caplog):
    """The memory is split between the sliding and full pools by each layer's bytes (the full layer's blocks take
    twice a sliding layer's): the caches fill the budget and stay within it; the log says what the sharing saves."""
    budget = 4 << 20
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = Engine(gemma4, PytorchEngineConfig(dtype='float32', block_size=16, max_cache_bytes=budget,
                                                    max_batch_size=4, max_prefill_token_num=256), show_progress=False)
    assert 'saving 768 bytes per token' in caplog.text
    runner = engine.runner
    assert runner.num_window_blocks is not None
    cache_bytes = sum(t.numel() * t.element_size() for cache in runner.kv_caches for t in cache)
    assert 0.95 * budget < cache_bytes <= budget + 2 * engine.model_config.kv_bytes_per_token() * 16


def test_multimodal_checkpoint_serves_its_language_model(gemma4, gemma4_multimodal):
    prompts = random_prompts([5, 40], seed=7)
    assert run(make_engine(gemma4_multimodal), prompts) == run(make_engine(gemma4), prompts)


def test_multimodal_checkpoint_refuses_images_and_audio(gemma4_multimodal):
    assert_images_and_audio_refused(gemma4_multimodal)


def test_tensor_parallelism_is_refused(gemma4):
    with pytest.raises(ValueError, match='per-layer cache geometry'):
        make_engine(gemma4, tp=2)


@pytest.mark.slow
@pytest.mark.parametrize('fixture', ['gemma4', 'gemma4_moe'])
def test_bf16_within_twice_transformers(fixture, request):
    """bf16 on the CPU (the default dtype) stays as close to fp32 as transformers' own bf16 model."""
    assert_bf16_within_twice_transformers(request.getfixturevalue(fixture))
