"""Bamba (``BambaForCausalLM``: Mamba-2 layers and the attention layers of ``attn_layer_indices``, each followed by
a gated MLP; served as Granite 4.0-H's dense layout) against transformers on a tiny random model: greedy tokens and
first-step logits in fp32 (rotary over the first half of each attention head), batching, chunked prefill and
preemption equal to solo runs with the recurrent-state slots given back, and tensor parallelism refused."""
from __future__ import annotations

import pytest
from transformers import BambaConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import assert_matches_transformers, assert_slots_free, hf_causal_lm
from helpers import make_engine, random_prompts, run


@pytest.fixture(scope='module')
def bamba(tmp_path_factory) -> str:
    """Three layers, the second attention; eight Mamba heads of 16 in two B/C groups."""
    config = BambaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                         attn_layer_indices=[1], intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
                         mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, vocab_size=VOCAB_SIZE,
                         max_position_embeddings=1024, pad_token_id=None, architectures=['BambaForCausalLM'])
    return save_random_model(config, str(tmp_path_factory.mktemp('bamba')))


def test_greedy_and_first_logits_match_transformers(bamba):
    assert_matches_transformers(bamba, hf_causal_lm(bamba), random_prompts([3, 17, 70, 150]),
                                random_prompts([5, 33, 100], seed=1))


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(bamba):
    prompts = random_prompts([45, 90, 20], seed=3)
    engine = make_engine(bamba)
    plain = run(engine, prompts)
    assert [run(engine, [p])[0] for p in prompts] == plain
    chunked = make_engine(bamba, max_prefill_token_num=16, max_batch_size=4)
    assert run(chunked, prompts) == plain
    assert_slots_free(chunked)
    tight = make_engine(bamba, num_gpu_blocks=14)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_tensor_parallelism_is_refused(bamba):
    with pytest.raises(ValueError, match='Mamba-2 layers are not sharded for tensor parallelism; use tp=1'):
        make_engine(bamba, tp=2)
