"""Falcon-H1 (``FalconH1ForCausalLM``: attention and a Mamba-2 mixer side by side in every layer) against transformers
on tiny random models with every µP multiplier away from 1: greedy tokens and first-step logits in fp32 for the
three ways the gate meets the scan's output (no norm; the gated norm; the norm before the gate) and the biases;
every position's logits over chunked prefill; batching, chunked prefill and preemption equal to solo runs with the
KV blocks and state slots given back; a KV cache and a state slot in every layer; fp32 batch invariance; prefix
caching off, tensor parallelism refused, and bf16 on the CPU."""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from transformers import FalconH1Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_bf16_within_twice_transformers, assert_matches_transformers, assert_slots_free,
                           hf_causal_lm)
from helpers import make_engine, random_prompts, run

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.paging.state_pool import KVAndStates

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run as arrivals  # noqa: E402

MULTIPLIERS = dict(embedding_multiplier=3.0, lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=1.3,
                   attention_out_multiplier=0.8, ssm_in_multiplier=1.25, ssm_out_multiplier=0.6,
                   ssm_multipliers=[0.35, 0.25, 0.4, 0.5, 0.3], mlp_multipliers=[0.9, 0.6])
# mamba_rms_norm, mamba_norm_before_gate
GATE_NORMS = {'gate_only': (False, False), 'gate_then_norm': (True, False), 'norm_then_gate': (True, True)}


def falcon_h1_config(gate_norm: str = 'gate_only', in_proj_bias: bool = False,
                     out_proj_bias: bool = False) -> FalconH1Config:
    """Two layers; four attention heads of 24 (not ``hidden_size / heads``, as the released models) over two KV heads;
    six Mamba heads of 16 (``mamba_d_ssm`` 96, not ``mamba_expand * hidden_size``) in two B/C groups. With
    ``in_proj_bias`` the Mamba-2 ``in_proj`` and the attention and MLP have biases, with ``out_proj_bias`` the
    Mamba-2 ``out_proj`` (``projectors_bias``), and the embeddings are tied."""
    rms_norm, norm_before_gate = GATE_NORMS[gate_norm]
    return FalconH1Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                          num_hidden_layers=2, intermediate_size=96, mamba_d_ssm=96, mamba_n_heads=6,
                          mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                          mamba_rms_norm=rms_norm, mamba_norm_before_gate=norm_before_gate,
                          mamba_proj_bias=in_proj_bias, projectors_bias=out_proj_bias, attention_bias=in_proj_bias, mlp_bias=in_proj_bias,
                          vocab_size=VOCAB_SIZE, max_position_embeddings=1024, pad_token_id=None,
                          tie_word_embeddings=in_proj_bias or out_proj_bias,
                          architectures=['FalconH1ForCausalLM'], **MULTIPLIERS)


@pytest.fixture(scope='module')
def falcon_h1(tmp_path_factory) -> str:
    return save_random_model(falcon_h1_config(), str(tmp_path_factory.mktemp('falcon_h1')))


def test_greedy_and_first_logits_match_transformers(falcon_h1):
    assert_matches_transformers(falcon_h1, hf_causal_lm(falcon_h1), random_prompts([3, 17, 70, 150]),
                                random_prompts([5, 33, 100], seed=1))


@pytest.mark.parametrize('gate_norm, in_proj_bias, out_proj_bias', [('gate_then_norm', True, False),
                                                                     ('norm_then_gate', False, True)])
def test_gated_norms_and_biases_match_transformers(tmp_path, gate_norm, in_proj_bias, out_proj_bias):
    """The gated RMSNorm either side of the gate, with biases (the Mamba-2 ``in_proj``'s and ``out_proj``'s each
    without the other) and tied embeddings."""
    path = save_random_model(falcon_h1_config(gate_norm, in_proj_bias, out_proj_bias), str(tmp_path))
    assert_matches_transformers(path, hf_causal_lm(path), random_prompts([3, 70], seed=2), random_prompts([33], seed=1))


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(falcon_h1):
    """The states and the KV cache (blocks of 4) carry over between prefill chunks and a preempted sequence
    recomputes both from zero (chunks of 7, ending inside the convolution's window: Granite 4.0-H's test, the same
    mixer)."""
    prompts = random_prompts([70, 100, 20, 45], seed=3)
    engine = make_engine(falcon_h1)
    plain = run(engine, prompts)
    assert [run(engine, [p])[0] for p in prompts] == plain
    chunked = make_engine(falcon_h1, max_prefill_token_num=16, block_size=4, max_batch_size=4)
    assert run(chunked, prompts) == plain
    assert_slots_free(chunked)
    tight = make_engine(falcon_h1, num_gpu_blocks=14)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_every_layer_holds_a_kv_cache_and_states(falcon_h1, caplog):
    """Each layer's cache is its K and V blocks, then its convolution and SSM state slots; the KV budget pays for
    every layer; prefix caching, asked for, is off and says why; every position's logits equal transformers'
    (computed in chunks of 16, the states and the KV cache carried over)."""
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(falcon_h1, enable_prefix_caching=True, max_prefill_token_num=16, max_batch_size=3)
    assert not engine.block_manager.enable_prefix_caching
    assert 'prefix caching is off' in caplog.text
    assert all(isinstance(states, KVAndStates) for states in engine.runner.model.recurrent_state_shapes())
    num_blocks = engine.runner.scratch_block + 1
    for cache in engine.runner.kv_caches:
        assert [tuple(t.shape) for t in cache] == [(num_blocks, 2, 16, 24)] * 2 + [(3, 96 + 2 * 2 * 16, 3),
                                                                                    (3, 6, 16, 16)]
    assert engine.runner.cfg.kv_bytes_per_token() == 2 * 2 * 2 * 24 * 4  # two layers' K and V, fp32
    prompt = random_prompts([50], seed=7)[0]
    with torch.no_grad():
        expected = hf_causal_lm(falcon_h1)(torch.tensor([prompt])).logits[0]
    assert (engine.get_logits(prompt) - expected).abs().max().item() < 1e-3
    assert_slots_free(engine)


def test_fp32_is_batch_invariant(falcon_h1, native):
    """fp32 tokens and logprobs bitwise: prompts alone and arriving one a step beside the others' decode rows."""
    if cpu.fp32_gemm() is None:
        pytest.skip('the native fp32 GEMM needs AVX-512')
    engine = Engine(falcon_h1, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16,
                                                   max_batch_size=4, max_prefill_token_num=100), show_progress=False)
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)
    prompts = random_prompts([2, 9, 40, 140], seed=11)
    alone = [arrivals(engine, [prompt], config, 0)[0] for prompt in prompts]
    assert arrivals(engine, prompts, config, 0) == alone
    assert arrivals(engine, prompts, config, 1) == alone


def test_tensor_parallelism_is_refused(falcon_h1):
    with pytest.raises(ValueError, match='Mamba-2 layers are not sharded for tensor parallelism; use tp=1'):
        make_engine(falcon_h1, tp=2)


def test_bf16_close_to_transformers(falcon_h1):
    """bf16 on the CPU (packed GEMM weights, the multipliers folded into them): the last logits differ from
    transformers' in fp32 by at most twice what transformers' own bf16 model does."""
    assert_bf16_within_twice_transformers(falcon_h1)
