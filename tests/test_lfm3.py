"""LFM3 (``Lfm3ForCausalLM``: LFM2's short convolutions between full- and sliding-window attention layers, each
attention type with its own rope, heads gated by ``sigmoid(g_proj(x))``, sandwich norms) against transformers on a
tiny random model: greedy tokens and first-step logits in fp32 at prompts shorter and longer than the window, every
position's logits over chunked prefill, batching, chunked prefill and preemption equal to solo runs with the
convolution-state slots given back, prefix caching turned off and tensor parallelism refused."""
from __future__ import annotations


import pytest
from transformers import Lfm3Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_matches_transformers, assert_prefix_caching_off_and_every_logit_matches,
                           assert_slots_free, hf_causal_lm)
from helpers import make_engine, random_prompts, run

WINDOW = 16


def lfm3_config(**overrides) -> Lfm3Config:
    """Six layers (the hub's pattern: conv, conv, full, conv, sliding, conv) of four query heads of 16 features and
    two KV heads, sliding windows of 16 tokens, convolutions of 3 taps, transformers' per-type ropes (the full
    layers' proportional: half of each head's frequencies turn)."""
    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=6,
                  intermediate_size=96, conv_L_cache=3, sliding_window=WINDOW, vocab_size=VOCAB_SIZE,
                  max_position_embeddings=1024, pad_token_id=None, architectures=['Lfm3ForCausalLM'])
    return Lfm3Config(**(fields | overrides))


@pytest.fixture(scope='module')
def lfm3(tmp_path_factory) -> str:
    return save_random_model(lfm3_config(), str(tmp_path_factory.mktemp('lfm3')))


def test_config_has_every_lfm3_part():
    config = lfm3_config()
    assert config.layer_types == ['conv', 'conv', 'full_attention', 'conv', 'sliding_attention', 'conv']
    assert config.rope_parameters['full_attention']['rope_type'] == 'proportional'
    assert config.use_attention_gate and config.use_sandwich_norm


def test_greedy_and_first_logits_match_transformers(lfm3):
    """Prompts of 1 to 150 tokens: most longer than the window of the sliding layer."""
    assert_matches_transformers(lfm3, hf_causal_lm(lfm3), random_prompts([1, 2, 17, 70, 150]),
                                random_prompts([3, 33, 100], seed=1))


@pytest.mark.slow
def test_without_gate_and_sandwich_norms(tmp_path):
    """The options off (no ``g_proj``, no post norms): still transformers' tokens."""
    path = save_random_model(lfm3_config(use_attention_gate=False, use_sandwich_norm=False, num_hidden_layers=5),
                             str(tmp_path))
    assert_matches_transformers(path, hf_causal_lm(path), random_prompts([5, 40], seed=2),
                                random_prompts([30], seed=3))


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(lfm3):
    """The convolution states carry over between prefill chunks (of 16 tokens, and of 2: chunks shorter than the
    state) and a preempted sequence recomputes them from zero."""
    prompts = random_prompts([70, 100, 20, 45], seed=3)
    plain = run(make_engine(lfm3), prompts)
    assert [run(make_engine(lfm3), [p])[0] for p in prompts] == plain
    for chunk, few in ((16, 4), (2, 2)):
        engine = make_engine(lfm3, max_prefill_token_num=chunk, block_size=chunk, max_batch_size=4,
                             num_gpu_blocks=2048 // chunk)
        assert run(engine, prompts[-few:]) == plain[-few:]
        assert_slots_free(engine)
    tight = make_engine(lfm3, num_gpu_blocks=10)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_get_logits_prefix_caching_off_and_tp_refused(lfm3, caplog):
    """Every position's logits equal transformers' (computed in chunks of 16, the states carried over); prefix
    caching, asked for, is off; tp=2 is refused."""
    engine = assert_prefix_caching_off_and_every_logit_matches(lfm3, caplog)
    assert engine.runner.cfg.num_state_layers == 4
    with pytest.raises(ValueError, match='short-convolution layers are not sharded for tensor parallelism'):
        make_engine(lfm3, tp=2)
