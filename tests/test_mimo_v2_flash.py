"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32 (queries and keys wider than values, values scaled, sliding-window layers of
twice the full layers' KV heads with a sink logit per head, a rope per layer type over a third of the features, a
dense first layer, then DeepSeek-V3's routing without shared experts) at prompts longer than the window, the hub's
sink and next-token-prediction tensors, batching, chunked prefill and prefix-cache hits, and tensor parallelism."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MiMoV2FlashConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_bf16_within_twice_transformers,
                           assert_correction_bias_loaded_and_routing, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import make_engine, random_prompts, run

from lmdeploy.pytorch.config import ModelConfig

WINDOW = 16
LAYER_TYPES = ['full_attention', 'sliding_attention', 'sliding_attention', 'full_attention']


def mimo_config(**overrides) -> MiMoV2FlashConfig:
    """Four query heads of 32 query/key features and 16 value features over a hidden size of 64; two KV heads in the
    full layers (the first and last), four in the sliding ones (window 16); a dense first layer, then 8 experts, top
    2, in two groups of which one is chosen."""
    fields = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, v_head_dim=16, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=2, topk_group=1, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                  vocab_size=VOCAB_SIZE, max_position_embeddings=1024)
    return MiMoV2FlashConfig(**(fields | overrides))


@pytest.fixture(scope='module')
def mimo(tmp_path_factory) -> str:
    """The routers' correction biases random, large enough to change choices."""
    return save_random_model(mimo_config(), str(tmp_path_factory.mktemp('mimo')),
                             std={'e_score_correction_bias': 0.3})


def test_checkpoint_holds_hub_sinks_of_sliding_layers(mimo):
    """transformers saves the sinks under the hub's name, in the sliding layers only."""
    names = load_file(str(Path(mimo) / 'model.safetensors')).keys()
    assert sorted(name for name in names if 'sink' in name) == [
        f'model.layers.{i}.self_attn.attention_sink_bias' for i in (1, 2)]


def test_cache_holds_the_sliding_layers_kv_heads(mimo):
    cfg = ModelConfig.from_hf(hf_causal_lm(mimo).config, torch.float32)
    assert (cfg.num_kv_heads, cfg.head_dim) == (4, 32)


def test_greedy_and_first_logits_match_transformers(mimo):
    """Prompts shorter and several times longer than the window."""
    assert_matches_transformers(mimo, hf_causal_lm(mimo), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_sinks_are_loaded_and_change_the_tokens(mimo):
    """Each sliding layer's sinks equal the checkpoint's ``attention_sink_bias``; set far below every score (no weight
    left to them), the tokens differ."""
    engine = make_engine(mimo)
    hf_layers = hf_causal_lm(mimo).model.layers
    sliding = [i for i, kind in enumerate(LAYER_TYPES) if kind == 'sliding_attention']
    for i in sliding:
        assert engine.runner.model.layers[i].self_attn.attn.sinks.equal(hf_layers[i].self_attn.sinks)
    prompts = random_prompts([20, 45], seed=5)
    outs = run(engine, prompts)
    for i in sliding:
        engine.runner.model.layers[i].self_attn.attn.sinks.fill_(-1e4)
    assert run(engine, prompts) != outs


def test_correction_bias_is_loaded_and_routes(mimo):
    assert_correction_bias_loaded_and_routing(mimo, 'mlp.gate.e_score_correction_bias')


def test_next_token_prediction_layers_are_skipped(mimo, tmp_path):
    """A checkpoint with the hub's ``model.mtp.*`` tensors loads and gives the same tokens."""
    folder = tmp_path / 'with_mtp'
    folder.mkdir()
    for file in Path(mimo).iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    state = load_file(str(folder / 'model.safetensors'))
    state['model.mtp.layers.0.input_layernorm.weight'] = torch.ones(64)
    state['model.mtp.layers.0.self_attn.q_proj.weight'] = torch.zeros(128, 64)
    save_file(state, str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    prompts = random_prompts([12, 33], seed=7)
    assert run(make_engine(str(folder)), prompts) == run(make_engine(mimo), prompts)


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(mimo):
    assert_batched_chunked_and_cached_equal_solo(mimo, prefix_sharing_prompts())


@pytest.mark.slow
def test_tp2_equals_tp1(mimo):
    """Each rank computes its query heads, the KV heads they read (one of the full layers', two of the sliding
    layers'), those heads' sinks and its share of every expert."""
    assert_tp2_equals_tp1(mimo, random_prompts([5, 40], seed=8), logits=True)


def test_bf16_within_twice_transformers(mimo, native_gemms):
    """bf16 on the native GEMMs, outside the native decoder stack
    (its values narrower than its keys are no option of the stack): logits within twice transformers' own bf16 error."""
    assert_bf16_within_twice_transformers(mimo)
