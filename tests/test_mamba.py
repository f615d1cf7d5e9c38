"""Mamba and Falcon Mamba (``MambaForCausalLM``, ``FalconMambaForCausalLM``: Mamba-1 blocks only) against transformers
on tiny random models: greedy tokens and first-step logits in fp32 (Falcon Mamba's weightless norms on dt/B/C, its
projections with biases, an untied LM head), batching, chunked prefill and preemption equal to solo runs with the
state slots given back, an engine sized from memory with no KV cache at all (and saying so), bf16 on the CPU,
tensor parallelism refused."""
from __future__ import annotations

import logging

import pytest
from transformers import FalconMambaConfig, MambaConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_bf16_within_twice_transformers, assert_matches_transformers, assert_slots_free,
                           hf_causal_lm)
from helpers import make_engine, random_prompts, run

SHAPE = dict(hidden_size=64, num_hidden_layers=3, state_size=8, expand=2, conv_kernel=4, time_step_rank=8,
             vocab_size=VOCAB_SIZE, pad_token_id=None)
VARIANTS = {
    'mamba': lambda: MambaConfig(architectures=['MambaForCausalLM'], **SHAPE),
    'falcon_mamba': lambda: FalconMambaConfig(architectures=['FalconMambaForCausalLM'], use_bias=True,
                                              tie_word_embeddings=False, mixer_rms_eps=1e-5, **SHAPE),
}


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def mamba_model(request, tmp_path_factory) -> str:
    return save_random_model(VARIANTS[request.param](), str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def falcon_mamba(tmp_path_factory) -> str:
    return save_random_model(VARIANTS['falcon_mamba'](), str(tmp_path_factory.mktemp('falcon_mamba')))


def test_greedy_and_first_logits_match_transformers(mamba_model):
    assert_matches_transformers(mamba_model, hf_causal_lm(mamba_model), random_prompts([3, 17, 70, 150]),
                                random_prompts([5, 33, 100], seed=1))


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(falcon_mamba):
    """The states carry over between prefill chunks of 7 tokens (ending inside the convolution's window); with
    few blocks (which only count tokens here) sequences are preempted and recompute their states from zero."""
    prompts = random_prompts([70, 100, 20, 45], seed=3)
    plain = run(make_engine(falcon_mamba), prompts)
    assert [run(make_engine(falcon_mamba), [p])[0] for p in prompts] == plain
    chunked = make_engine(falcon_mamba, max_prefill_token_num=7, block_size=4, max_batch_size=4)
    assert run(chunked, prompts) == plain
    assert_slots_free(chunked)
    tight = make_engine(falcon_mamba, num_gpu_blocks=14)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_no_kv_cache(falcon_mamba, caplog):
    """Sized from memory (no ``num_gpu_blocks``), a model without attention holds state slots only, blocks of no
    memory for a full batch of whole sessions, says that it keeps no KV cache, and serves."""
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(falcon_mamba, num_gpu_blocks=0, max_batch_size=4, session_len=256)
    assert 'KV cache: none' in caplog.text and 'prefix caching is off' in caplog.text
    assert [len(cache) for cache in engine.runner.kv_caches] == [2, 2, 2]
    assert engine.runner.cfg.kv_bytes_per_token() == 0
    assert engine.block_manager.num_blocks == 4 * 256 // 16
    assert engine.scheduler.state_pool.num_slots == 4
    prompts = random_prompts([30, 9], seed=5)
    assert run(engine, prompts) == run(make_engine(falcon_mamba), prompts)
    assert_slots_free(engine)


def test_tensor_parallelism_is_refused(falcon_mamba):
    with pytest.raises(ValueError, match='Mamba-1 layers are not sharded for tensor parallelism; use tp=1'):
        make_engine(falcon_mamba, tp=2)


def test_bf16_close_to_transformers(mamba_model):
    """bf16 on the CPU (packed GEMM weights): the last logits differ from transformers' in fp32 by at most twice
    what transformers' own bf16 model does (which keeps the residual in fp32, ``residual_in_fp32``)."""
    assert_bf16_within_twice_transformers(mamba_model)
