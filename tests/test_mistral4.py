"""Mistral Small 4 (``Mistral4ForCausalLM``: DeepSeek-V3's latent attention and MoE with softmax routing and
Llama-4 query scaling) against transformers on tiny random models saved by transformers: greedy tokens and
first-step logits in fp32, batching, chunked prefill and prefix-cache hits, the routing and tensor parallelism."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Mistral4Config, Mistral4ForCausalLM
from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_native_stack_gives_the_layers_tokens, assert_tp2_equals_tp1, hf_causal_lm,
                           prefix_sharing_prompts)
from helpers import make_engine, random_prompts

from lmdeploy.pytorch.kernels import grouped_topk

# transformers 5.25 maps ``mistral4`` to Mistral4ForCausalLM for image-text-to-text only (the hub's Mistral Small 4
# is a Mistral 3 model): this registers it for the causal-LM helpers
AutoModelForCausalLM.register(Mistral4Config, Mistral4ForCausalLM, exist_ok=True)
KV_LORA_RANK, ROPE_DIM = 32, 8
# Mistral Small 4's rope (YaRN, mscale 1 on both sides, Llama-4 query scaling), over an original context of 32
# positions so that the queries' scale steps up twice within a prompt of 90 tokens and its 32 new ones
ROPE = {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0, 'original_max_position_embeddings': 32,
        'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0, 'llama_4_scaling_beta': 0.1}
# name -> config overrides: Mistral Small 4's shape (a query projection of low rank, every layer sparse, one group
# of experts), and a plain query projection with two groups, a dense first layer and scaled weights
VARIANTS = {
    'small4': dict(q_lora_rank=48),
    'groups_dense_first': dict(q_lora_rank=None, n_group=2, topk_group=1, first_k_dense_replace=1,
                               routed_scaling_factor=1.5),
}


def mistral4_config(**overrides) -> Mistral4Config:
    """Four heads over a latent of 32 (Mistral Small 4: 32 heads, 256), three layers of 8 experts (top 2) and a
    shared expert."""
    return Mistral4Config(**{**dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=16, v_head_dim=16, vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024, pad_token_id=None, rope_parameters=dict(ROPE)), **overrides})


def save_mistral4(path: str, **overrides) -> str:
    """A tiny random Mistral Small 4 saved with transformers."""
    return save_random_model(mistral4_config(**overrides), path)


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def mistral4(request, tmp_path_factory) -> str:
    return save_mistral4(str(tmp_path_factory.mktemp(request.param)), **VARIANTS[request.param])


def test_greedy_and_first_logits_match_transformers(mistral4):
    assert_matches_transformers(mistral4, hf_causal_lm(mistral4), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(tmp_path):
    """On Mistral Small 4's shape only (the other variant's layers batch alike)."""
    path = save_mistral4(str(tmp_path / 'small4'), **VARIANTS['small4'])
    assert_batched_chunked_and_cached_equal_solo(path, prefix_sharing_prompts())


def test_query_scaling_changes_late_tokens(tmp_path):
    """The queries' position scale is applied: without ``llama_4_scaling_beta`` the engine's greedy tokens of a
    prompt longer than the original context change (so the match above depends on it)."""
    prompts = random_prompts([90], seed=5)
    scaled = save_mistral4(str(tmp_path / 'scaled'), **VARIANTS['small4'])
    plain = save_mistral4(str(tmp_path / 'plain'), **VARIANTS['small4'],
                          rope_parameters={k: v for k, v in ROPE.items() if k != 'llama_4_scaling_beta'})
    engine = make_engine(scaled)
    assert engine.runner.model.layers[0].self_attn.scaled_queries
    logits = [make_engine(path).get_logits(prompts[0])[-1] for path in (scaled, plain)]
    assert (logits[0] - logits[1]).abs().max() > 1e-3


def test_softmax_grouped_routing_matches_transformers_router():
    """Mistral 4's router (softmax scores, groups by their two best, no correction bias) is :func:`grouped_topk`
    over softmax scores, with and without renormalization."""
    config = mistral4_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                             routed_scaling_factor=1.5)
    for renormalize in (True, False):
        config.norm_topk_prob = renormalize
        router = Mistral4TopkRouter(config)
        torch.manual_seed(1)
        router.weight.data.normal_()
        x = torch.randn(20, config.hidden_size)
        logits, hf_weights, hf_ids = router(x)
        weights, ids = grouped_topk(logits, None, 3, 4, 2, renormalize, 1.5, softmax=True)
        order, hf_order = ids.sort(-1).indices, hf_ids.sort(-1).indices
        assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
        torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_bf16_native_stack_gives_the_layers_tokens(tmp_path, native_gemms):
    """bf16 on the native GEMMs, Mistral Small 4's shape: every layer runs in the native decoder stack (the latent
    attention scaling its queries by position, prompts past the scale's first steps; the MoE layers as MoE blocks
    routed ``softmax``, one group and unscaled weights), with the tokens of the layers' own forward; a strong scale
    (``llama_4_scaling_beta`` 1: twice the queries from position 64) so that bf16's tokens show it."""
    rope = dict(ROPE, llama_4_scaling_beta=1.0)
    assert_native_stack_gives_the_layers_tokens(save_mistral4(str(tmp_path / 'small4'), **VARIANTS['small4'],
                                                              rope_parameters=rope))


def test_tp2_equals_tp1(tmp_path):
    """Each rank computes its own heads (their share of ``q_b_proj`` and ``kv_b_proj``) and its share of every
    expert and of the shared expert."""
    assert_tp2_equals_tp1(save_mistral4(str(tmp_path / 'small4'), **VARIANTS['small4']),
                          random_prompts([5, 40], seed=8))
