"""Gemma 3n (``Gemma3nForCausalLM``, and ``Gemma3nForConditionalGeneration`` read for its language model) against
transformers on a tiny random model saved by transformers: AltUp streams, LAuReL, per-layer inputs (tokens past the
per-layer table too), activation sparsity on the first layers, sliding-window layers narrower than most prompts and
KV-sharing layers that attend over an earlier layer's cache; batching, chunked prefill and prefix-cache hits; the
KV-sharing layers holding no cache; text-only serving of the multimodal checkpoint."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3nConfig, Gemma3nTextConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_bf16_within_twice_transformers,
                           assert_matches_transformers, first_step_logits, hf_causal_lm, prefix_sharing_prompts)
from helpers import make_engine, random_prompts, run
from server_helpers import serve, tiny_engine

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

SLIDING, FULL = 'sliding_attention', 'full_attention'
WINDOW = 16


def gemma3n_config(**overrides) -> Gemma3nTextConfig:
    """Five layers (sliding, sliding, full, then a sliding and a full one that share the KV of layers 1 and 2) of four
    query heads and two KV heads of 16 features over a hidden size of 64, four AltUp streams, per-layer inputs of 16
    features from a table of 256 tokens (of 320), and activation sparsity 0.95 on the first two layers."""
    shape = dict(hidden_size=64, intermediate_size=[128, 96, 128, 96, 128], num_hidden_layers=5,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE,
                 vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, laurel_rank=8,
                 num_kv_shared_layers=2, sliding_window=WINDOW, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
                 activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0], max_position_embeddings=1024,
                 pad_token_id=None)
    return Gemma3nTextConfig(**{**shape, **overrides})


@pytest.fixture(scope='module')
def gemma3n(tmp_path_factory) -> str:
    return save_random_model(gemma3n_config(), str(tmp_path_factory.mktemp('gemma3n')))


@pytest.fixture(scope='module')
def gemma3n_multimodal(gemma3n, tmp_path_factory) -> str:
    """The tiny model as the hub lays out ``Gemma3nForConditionalGeneration``: its language model under
    ``model.language_model.``, beside vision and audio tower tensors (an audio ``q_proj`` among them) and the keys and
    values older checkpoints keep for the KV-sharing layers."""
    path = tmp_path_factory.mktemp('gemma3n_multimodal')
    for name in Path(gemma3n).iterdir():
        if name.name not in ('config.json', 'model.safetensors'):
            shutil.copy(name, path)
    tensors = {name.replace('model.', 'model.language_model.', 1): tensor
               for name, tensor in load_file(f'{gemma3n}/model.safetensors').items()}
    g = torch.Generator().manual_seed(5)
    for name in ('model.audio_tower.conformer.0.attention.attn.q_proj.weight', 'model.embed_audio.embedding.weight',
                 'model.vision_tower.timm_model.conv_stem.conv.weight', 'model.embed_vision.embedding.weight',
                 'model.language_model.layers.3.self_attn.k_proj.weight',
                 'model.language_model.layers.4.self_attn.v_proj.weight'):
        tensors[name] = torch.randn(32, 64, generator=g)
    save_file(tensors, f'{path}/model.safetensors', metadata={'format': 'pt'})
    text_config = json.loads(Path(gemma3n, 'config.json').read_text())
    config = Gemma3nConfig(text_config=gemma3n_config(eos_token_id=text_config['eos_token_id'],
                                                      bos_token_id=text_config['bos_token_id']).to_dict())
    config.architectures = ['Gemma3nForConditionalGeneration']
    config.save_pretrained(path)
    return str(path)


def test_config_shares_kv_as_transformers_does():
    from lmdeploy.pytorch.models.gemma3n import kv_sources
    config = gemma3n_config()
    assert config.kv_sharing_modes == [None, 'store', 'store', 'reuse', 'reuse']
    assert kv_sources(config) == [None, None, None, 1, 2]


@pytest.mark.parametrize('layers, shared, saved', [(30, 10, 20480), (35, 15, 30720)])
def test_hub_shapes_keep_twenty_caches(layers, shared, saved):
    """E2B's and E4B's text configs (transformers' defaults are E4B's): in bf16 the KV-sharing layers save 2048 bytes
    per token each, and each shares the last layer of its kind before them (19 full, 18 sliding)."""
    from lmdeploy.pytorch.config import ModelConfig
    from lmdeploy.pytorch.models.gemma3n import kv_sources
    config = Gemma3nConfig(text_config=Gemma3nTextConfig(num_hidden_layers=layers, num_kv_shared_layers=shared,
                                                         intermediate_size=8192).to_dict())
    config.architectures = ['Gemma3nForConditionalGeneration']
    cfg = ModelConfig.from_hf(config, torch.bfloat16)
    assert cfg.kv_bytes_per_token() == 20 * 2048 and cfg.num_kv_shared_layers * cfg.kv_bytes_per_layer_token() == saved
    sources = kv_sources(cfg.hf_config)
    assert sources[:20] == [None] * 20 and set(sources[20:]) == {18, 19}


def test_greedy_and_first_logits_match_transformers(gemma3n):
    """Prompts of 52 and 90 tokens run past the 16-token window; generated tokens past the per-layer table."""
    assert_matches_transformers(gemma3n, hf_causal_lm(gemma3n), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60], vocab=VOCAB_SIZE))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(gemma3n):
    """Prompts of 40 to 50 tokens, past the window; two share the first's 32-token prefix."""
    assert_batched_chunked_and_cached_equal_solo(gemma3n, prefix_sharing_prompts((40, 50), 32, (10, 12)))


def test_kv_sharing_layers_hold_no_cache(gemma3n, caplog):
    """Only the three layers with keys and values of their own hold a cache, and the memory's blocks are split over
    those alone: the cache fills the budget (the sliding layers in a pool of their own); the start-up log says what
    the sharing saves."""
    budget = 4 << 20
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = Engine(gemma3n, PytorchEngineConfig(dtype='float32', block_size=16, max_cache_bytes=budget,
                                                     max_batch_size=4, max_prefill_token_num=256),
                        show_progress=False)
    assert '2 of the 5 layers attend over an earlier layer\'s KV cache and hold none, saving 512 bytes per token' in (
        caplog.text)
    runner, cfg = engine.runner, engine.model_config
    assert [len(cache) > 0 for cache in runner.kv_caches] == [True, True, True, False, False]
    assert cfg.kv_bytes_per_token() == 3 * cfg.kv_bytes_per_layer_token() == 3 * 2 * 2 * 16 * 4
    assert runner.num_window_blocks is not None
    cache_bytes = sum(t.numel() * t.element_size() for cache in runner.kv_caches for t in cache)
    assert 0.95 * budget < cache_bytes <= budget + 3 * 2 * cfg.kv_bytes_per_layer_token() * 16


def test_kv_sharing_layers_write_no_cache(gemma3n, monkeypatch):
    """A prefill step writes keys and values for the three layers that own them, not again for the two that share."""
    from lmdeploy.pytorch.nn import attention
    filled = []
    fill = attention.fill_kv_cache
    monkeypatch.setattr(attention, 'fill_kv_cache', lambda *args: filled.append(args[2]) or fill(*args))
    engine = make_engine(gemma3n)
    first_step_logits(engine, random_prompts([20]))
    caches = engine.runner.kv_caches
    assert [id(k_cache) for k_cache in filled] == [id(caches[i][0]) for i in range(3)]


def test_multimodal_checkpoint_serves_its_language_model(gemma3n, gemma3n_multimodal):
    prompts = random_prompts([5, 40], seed=7)
    assert run(make_engine(gemma3n_multimodal), prompts) == run(make_engine(gemma3n), prompts)


def test_multimodal_checkpoint_refuses_images_and_audio(gemma3n_multimodal):
    assert_images_and_audio_refused(gemma3n_multimodal)


def assert_images_and_audio_refused(path: str) -> None:
    """A text-only family's multimodal checkpoint served: image and audio parts get a 400 naming them, text a 200."""
    for server in serve(tiny_engine(path), model_name='tiny'):
        def error(part: dict) -> str:
            body = {'model': 'tiny', 'max_tokens': 4,
                    'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 'what is it?'}, part]}]}
            response = httpx.post(f'{server.url}/v1/chat/completions', json=body)
            assert response.status_code == 400, response.text
            return response.json()['error']['message']

        assert 'does not accept images' in error({'type': 'image_url', 'image_url': {'url': 'x.png'}})
        assert 'does not accept audio' in error({'type': 'input_audio',
                                                 'input_audio': {'data': 'AAAA', 'format': 'wav'}})
        chat = {'model': 'tiny', 'max_tokens': 4, 'messages': [{'role': 'user', 'content': 'hi'}]}
        assert httpx.post(f'{server.url}/v1/chat/completions', json=chat).status_code == 200


def test_tensor_parallelism_is_refused(gemma3n):
    with pytest.raises(ValueError, match='activation-sparsity cutoff'):
        make_engine(gemma3n, tp=2)


@pytest.mark.slow
def test_bf16_within_twice_transformers(gemma3n):
    """bf16 on the CPU's packed GEMMs (the default dtype) stays as close to fp32 as transformers' own bf16 model."""
    assert_bf16_within_twice_transformers(gemma3n)
