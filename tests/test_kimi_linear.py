"""Kimi-Linear (``KimiLinearForCausalLM``) against transformers on a tiny random model: the delta rule with a decay
per key feature (KDA) against transformers' chunked rule, greedy tokens and first-step logits in fp32, batching,
chunked prefill and preemption equal to solo runs with every state slot given back, prefix caching turned off,
tensor parallelism refused, the native decode kernels run by the engine, and bf16 on the CPU."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_equals_solo_and_frees, assert_bf16_within_twice_transformers,
                           assert_matches_transformers, assert_prefix_caching_off_and_every_logit_matches,
                           assert_slots_free, hf_causal_lm)
from helpers import make_engine, random_prompts, run
from test_qwen3_next import assert_chunks_then_decode_match

from lmdeploy.pytorch.kernels import cpu

# KDA, KDA, latent attention, KDA (the checkpoints put one latent-attention layer after three KDA ones); the first
# layer's MLP dense, the others experts with a shared one
CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              linear_head_dim=16, linear_num_heads=4, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
              layer_types=['linear_attention', 'linear_attention', 'full_attention', 'linear_attention'],
              pad_token_id=None)


@pytest.fixture(scope='module')
def kimi_linear(tmp_path_factory) -> str:
    return save_random_model(KimiLinearConfig(**CONFIG), str(tmp_path_factory.mktemp('kimi_linear')))


def test_per_feature_delta_rule_matches_transformers():
    """The chunked rule over two calls (the state carried over), then the one-token steps on a state pool's row, with
    a decay per head and key feature, give transformers' KDA chunked rule over the whole sequence and its final
    state."""
    g = torch.Generator().manual_seed(0)
    length, split, heads, dim = 150, 70, 3, 8
    q, k, v = (torch.randn(1, length, heads, dim, generator=g) for _ in range(3))
    decay, beta = -torch.rand(1, length, heads, dim, generator=g) * 2, torch.rand(1, length, heads, generator=g)
    expected, expected_state = chunk_kimi_delta_attention(q, k, v, decay, beta, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    assert_chunks_then_decode_match(q, k, v, decay, beta, split, expected, expected_state)


def test_greedy_and_first_logits_match_transformers(kimi_linear):
    assert_matches_transformers(kimi_linear, hf_causal_lm(kimi_linear), random_prompts([3, 17, 70, 150]),
                                random_prompts([5, 33, 100], seed=1))


def test_batched_chunked_and_preempted_equal_solo(kimi_linear):
    """The state carries over between prefill chunks (of 16 tokens, and of 7: chunks that end inside the conv
    window) and a preempted sequence recomputes it from zero; every slot and block comes back."""
    engine = make_engine(kimi_linear, max_batch_size=4)
    prompts, plain = assert_batched_equals_solo_and_frees(engine, VOCAB_SIZE)
    for chunk, block_size in ((16, 16), (7, 4)):
        engine = make_engine(kimi_linear, max_prefill_token_num=chunk, block_size=block_size, max_batch_size=4)
        assert run(engine, prompts) == plain
        assert_slots_free(engine)
    tight = make_engine(kimi_linear, num_gpu_blocks=6)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_prefix_caching_off_and_every_logit_matches(kimi_linear, caplog):
    """Prefix caching, asked for, is off and says why; every position's logits equal transformers' (computed in
    chunks of 16, the state carried over)."""
    assert_prefix_caching_off_and_every_logit_matches(kimi_linear, caplog)


def test_decode_runs_the_native_per_feature_kernel(kimi_linear, monkeypatch):
    """On a CPU with the native AVX-512 build the decode steps run the native delta rule with the per-feature decay
    ``[B, H, Dk]``; with the build switched off the torch twin gives the same tokens."""
    native = cpu.gated_delta()
    if native is None:
        pytest.skip('the native gated delta kernel is built only with AVX-512')
    shapes = Counter()

    class Recording:
        def __getattr__(self, name):
            kernel = getattr(native, name)
            if name != 'gated_delta_decode':
                return kernel

            def call(q, k, v, g, *args):
                shapes[g.dim()] += 1
                return kernel(q, k, v, g, *args)
            return call

    prompts = random_prompts([9, 40], seed=5)
    monkeypatch.setattr(cpu, 'gated_delta', lambda: Recording())
    with_native = run(make_engine(kimi_linear), prompts)
    assert shapes[3] > 0 and not shapes[2]
    monkeypatch.setattr(cpu, 'gated_delta', lambda: None)
    monkeypatch.setattr(cpu, 'native', lambda: None)
    assert run(make_engine(kimi_linear), prompts) == with_native


def test_tensor_parallelism_is_refused(kimi_linear):
    with pytest.raises(ValueError, match='delta-attention layers are not sharded'):
        make_engine(kimi_linear, tp=2)


@pytest.mark.slow
def test_bf16_close_to_transformers(kimi_linear):
    """bf16 on the CPU: the last logits differ from transformers' in fp32 by at most twice what transformers' own
    bf16 model does."""
    assert_bf16_within_twice_transformers(kimi_linear)
