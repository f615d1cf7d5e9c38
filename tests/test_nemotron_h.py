"""Nemotron-H (``NemotronHForCausalLM``: Mamba-2, attention, squared-ReLU MLP and MoE blocks) against transformers on
tiny random models: greedy tokens and first-step logits in fp32 (MLP blocks; MoE blocks with and without the latent
projections), batching, chunked prefill and preemption equal to solo runs with the recurrent-state slots given back,
no KV cache for the MLP and MoE blocks, the hub's ``hybrid_override_pattern``, bf16 on the CPU, and tensor
parallelism refused."""
from __future__ import annotations

import json
import os

import pytest
from transformers import NemotronHConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_bf16_within_twice_transformers, assert_matches_transformers, assert_slots_free,
                           hf_causal_lm)
from helpers import make_engine, random_prompts, run

PATTERN = 'M-*-M-'  # Mamba-2, MLP, attention, MLP, Mamba-2, MLP


def nemotron_h_config(pattern: str = PATTERN) -> NemotronHConfig:
    """Eight Mamba heads of 16 in two B/C groups; four attention heads of 16 over two KV heads."""
    return NemotronHConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=96, hybrid_override_pattern=pattern, mamba_num_heads=8,
                           mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, vocab_size=VOCAB_SIZE,
                           max_position_embeddings=1024, architectures=['NemotronHForCausalLM'], pad_token_id=None,
                           tie_word_embeddings=False)


def nemotron_3_config(latent: int | None) -> NemotronHConfig:
    """MoE blocks of four squared-ReLU experts of 32 (two chosen, among the best of two groups of two), shared experts
    of 48, optionally through a latent projection of ``latent``."""
    config = nemotron_h_config('M*EME')
    config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group = 4, 2, 2, 1
    config.moe_intermediate_size, config.moe_shared_expert_intermediate_size = 32, 48
    config.routed_scaling_factor, config.moe_latent_size = 2.5, latent
    return config


@pytest.fixture(scope='module')
def nemotron_h(tmp_path_factory) -> str:
    return save_random_model(nemotron_h_config(), str(tmp_path_factory.mktemp('nemotron_h')))


def test_greedy_and_first_logits_match_transformers(nemotron_h):
    assert_matches_transformers(nemotron_h, hf_causal_lm(nemotron_h), random_prompts([3, 17, 70, 150]),
                                random_prompts([5, 33, 100], seed=1))


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(nemotron_h):
    prompts = random_prompts([100, 130, 20, 45], seed=3)
    plain = run(make_engine(nemotron_h), prompts)
    assert [run(make_engine(nemotron_h), [p])[0] for p in prompts] == plain
    chunked = make_engine(nemotron_h, max_prefill_token_num=16, max_batch_size=4)
    assert run(chunked, prompts) == plain
    assert_slots_free(chunked)
    tight = make_engine(nemotron_h, num_gpu_blocks=14)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_mlp_blocks_hold_no_cache(nemotron_h):
    """Only the attention block holds KV blocks (and pays for them), only the Mamba-2 blocks state slots."""
    engine = make_engine(nemotron_h)
    caches = engine.runner.kv_caches
    assert [len(cache) for cache in caches] == [2, 0, 2, 0, 2, 0]
    assert caches[2][0].shape[1:] == (2, 16, 16) and caches[0][1].shape[1:] == (8, 16, 16)
    cfg = engine.runner.cfg
    assert (cfg.num_state_layers, cfg.num_cacheless_layers) == (2, 3)
    assert cfg.kv_bytes_per_token() == 2 * 2 * 16 * 4  # one layer's K and V of 2 heads of 16, fp32


def test_hub_pattern(nemotron_h, tmp_path):
    """The hub's configs give the blocks as ``hybrid_override_pattern``: the same model, the same tokens."""
    hub = tmp_path / 'hub'
    hub.mkdir()
    for name in os.listdir(nemotron_h):
        if name != 'config.json':
            (hub / name).symlink_to(os.path.join(nemotron_h, name))
    config = json.loads(open(os.path.join(nemotron_h, 'config.json')).read())
    del config['layers_block_type']
    config['hybrid_override_pattern'] = PATTERN
    (hub / 'config.json').write_text(json.dumps(config))
    prompts = random_prompts([9, 70], seed=4)
    assert run(make_engine(str(hub)), prompts) == run(make_engine(nemotron_h), prompts)


def test_tensor_parallelism_is_refused(nemotron_h):
    with pytest.raises(ValueError, match='Mamba-2 layers are not sharded for tensor parallelism; use tp=1'):
        make_engine(nemotron_h, tp=2)


@pytest.mark.parametrize('latent', [None, 48])
def test_moe_blocks_match_transformers(tmp_path, latent):
    """Nemotron 3's MoE blocks (the correction bias drawn, so that it bites), batched equal to solo; they hold no
    cache."""
    path = save_random_model(nemotron_3_config(latent), str(tmp_path), std={'e_score_correction_bias': 0.5})
    prompts = random_prompts([3, 70], seed=2)
    assert_matches_transformers(path, hf_causal_lm(path), prompts, random_prompts([33], seed=1))
    engine = make_engine(path)
    assert [len(cache) for cache in engine.runner.kv_caches] == [2, 2, 0, 2, 0]
    assert [run(engine, [p])[0] for p in prompts] == run(engine, prompts)


def test_bf16_close_to_transformers(nemotron_h):
    """bf16 on the CPU (packed GEMM weights): the last logits differ from transformers' in fp32 by at most twice
    what transformers' own bf16 model does."""
    assert_bf16_within_twice_transformers(nemotron_h)
