"""Jamba (``JambaForCausalLM``: Mamba-1 layers, attention without positions, MoE) against transformers on a tiny
random model: the selective scan and its recurrence against transformers' torch implementation, greedy tokens and
first-step logits in fp32 (dense and expert layers, the top-k weights not renormalized), fp32 batch invariance,
batching, chunked prefill (chunks ending anywhere) and preemption equal to solo runs with the recurrent-state slots
given back, prefix caching turned off, tensor parallelism refused, and bf16 on the CPU."""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import JambaConfig
from transformers.models.jamba.modeling_jamba import mamba_selective_scan, mamba_selective_state_update

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_bf16_within_twice_transformers, assert_matches_transformers, assert_slots_free,
                           hf_causal_lm)
from helpers import make_engine, random_prompts, run

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.mamba1 import SCAN_CHUNK, selective_decode, selective_scan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run as arrivals  # noqa: E402


def jamba_config() -> JambaConfig:
    """Layers Mamba, Mamba + MoE, attention, Mamba + MoE (4 experts, top 2); Mamba-1 of 128 channels, 8 state
    features, dt rank 8; four attention heads of 16 over two KV heads."""
    return JambaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                       expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8,
                       mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, vocab_size=VOCAB_SIZE,
                       max_position_embeddings=1024, architectures=['JambaForCausalLM'], pad_token_id=None)


@pytest.fixture(scope='module')
def jamba(tmp_path_factory) -> str:
    return save_random_model(jamba_config(), str(tmp_path_factory.mktemp('jamba')))


def test_scan_matches_transformers():
    """The scan over two calls (split inside a discretization chunk, the state carried over) gives the bits of one
    call; continued by the one-token recurrence on a state pool's row it gives transformers' scan over the whole
    sequence and its final state."""
    g = torch.Generator().manual_seed(0)
    length, split, channels, state_size = 150, 100, 12, 6
    x, dt_raw = torch.randn(1, channels, length, generator=g), torch.randn(1, channels, length, generator=g)
    dt_bias = torch.randn(channels, generator=g)
    A = -torch.rand(channels, state_size, generator=g) * 3
    B, C = (torch.randn(1, state_size, length, generator=g) for _ in range(2))
    expected, expected_state = mamba_selective_scan(x, dt_raw, A, B, C, delta_bias=dt_bias,
                                                    delta_softplus=True, return_last_state=True)
    dt = F.softplus(dt_raw[0] + dt_bias[:, None]).T
    x, B, C = x[0].T, B[0].T, C[0].T
    whole, whole_state = selective_scan(x, dt, A, B, C, None)
    cut = SCAN_CHUNK + 7
    first, state = selective_scan(x[:cut], dt[:cut], A, B[:cut], C[:cut], None)
    rest, rest_state = selective_scan(x[cut:], dt[cut:], A, B[cut:], C[cut:], state)
    assert torch.equal(whole, torch.cat([first, rest])) and torch.equal(whole_state, rest_state)
    head, state = selective_scan(x[:split], dt[:split], A, B[:split], C[:split], None)
    pool, slot = torch.zeros(3, channels, state_size), torch.tensor([1])
    pool[1] = state
    tail = [selective_decode(x[None, t], dt[None, t], A, B[None, t], C[None, t], pool, slot)
            for t in range(split, length)]
    torch.testing.assert_close(torch.cat([head, *tail]), expected[0].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], expected_state[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat([head, *tail]), whole) and not pool[0].any() and not pool[2].any()
    ref_state = torch.zeros(1, channels, state_size)
    steps = [mamba_selective_state_update(ref_state, x[None, t], dt_raw[:, :, t], A, B[None, t], C[None, t],
                                          dt_bias=dt_bias, dt_softplus=True) for t in range(length)]
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-5, rtol=1e-5)


def test_greedy_and_first_logits_match_transformers(jamba):
    assert_matches_transformers(jamba, hf_causal_lm(jamba), random_prompts([3, 17, 70, 150]),
                                random_prompts([5, 33, 100], seed=1))


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(jamba):
    """The states carry over between prefill chunks (of 16 tokens, and of 7: chunks that end inside the
    convolution's window) and a preempted sequence recomputes them from zero."""
    prompts = random_prompts([70, 100, 20, 45], seed=3)
    plain = run(make_engine(jamba), prompts)
    assert [run(make_engine(jamba), [p])[0] for p in prompts] == plain
    for chunk, block_size in ((16, 16), (7, 4)):
        engine = make_engine(jamba, max_prefill_token_num=chunk, block_size=block_size, max_batch_size=4)
        assert run(engine, prompts) == plain
        assert_slots_free(engine)
    tight = make_engine(jamba, num_gpu_blocks=14)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


@pytest.mark.slow
def test_fp32_is_batch_invariant(jamba, native):
    """fp32 tokens and logprobs bitwise: prompts of up to 200 tokens in prefill chunks of at most 100, alone and
    arriving one a step beside the others' decode rows (the mixer's softplus, SiLUs and decay run ``placeless``)."""
    if cpu.fp32_gemm() is None:
        pytest.skip('the native fp32 GEMM needs AVX-512')
    engine = Engine(jamba, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16, max_batch_size=4,
                                               max_prefill_token_num=100), show_progress=False)
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)
    prompts = random_prompts([2, 9, 40, 140, 200], seed=11)
    alone = [arrivals(engine, [prompt], config, 0)[0] for prompt in prompts]
    assert arrivals(engine, prompts, config, 0) == alone
    assert arrivals(engine, prompts, config, 1) == alone


def test_state_slots_and_prefix_caching_off(jamba, caplog):
    """The Mamba layers take recurrent-state slots (conv ``[128, 3]``, SSM ``[128, 8]`` fp32), only the attention
    layer KV blocks; prefix caching, asked for, is off and says why."""
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(jamba, enable_prefix_caching=True)
    assert not engine.block_manager.enable_prefix_caching
    assert 'prefix caching is off' in caplog.text
    caches = engine.runner.kv_caches
    assert [len(cache) for cache in caches] == [2, 2, 2, 2]
    assert caches[0][0].shape[1:] == (128, 3) and caches[0][1].shape[1:] == (128, 8)
    assert caches[0][1].dtype == torch.float32 and caches[2][0].shape[1:] == (2, 16, 16)
    cfg = engine.runner.cfg
    assert cfg.num_state_layers == 3 and cfg.kv_bytes_per_token() == 2 * 2 * 16 * 4
    assert run(engine, random_prompts([40], seed=5))
    assert_slots_free(engine)


def test_tensor_parallelism_is_refused(jamba):
    with pytest.raises(ValueError, match='Mamba-1 layers are not sharded for tensor parallelism; use tp=1'):
        make_engine(jamba, tp=2)


def test_bf16_close_to_transformers(jamba):
    """bf16 on the CPU (packed GEMM weights): the last logits differ from transformers' in fp32 by at most twice
    what transformers' own bf16 model does."""
    assert_bf16_within_twice_transformers(jamba)
