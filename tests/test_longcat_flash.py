"""LongCat-Flash (``LongcatFlashForCausalLM``) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32, batching, chunked prefill and prefix-cache hits, two latent caches a layer,
the shortcut MoE's zero-computation experts, the multi-token-prediction weights left unused, the options refused,
tensor parallelism, and its ``<longcat_tool_call>`` tool calls."""
from __future__ import annotations

import os

import pytest
import torch
from parser_checks import split
from safetensors.torch import load_file, save_file
from transformers import LongcatFlashConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_bf16_within_twice_transformers,
                           assert_matches_transformers, assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import make_engine, random_prompts, run

from lmdeploy.pytorch.models.longcat_flash import LongcatFlashMoE, check_config
from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser
from lmdeploy.serve.reasoning import MODEL_PARSERS

KV_LORA_RANK, ROPE_DIM, NUM_EXPERTS = 32, 8, 8
YARN = {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0, 'original_max_position_embeddings': 64,
        'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0}
# name -> config overrides: the hub checkpoint's switches (zero experts, scaled weights, plain rotary of base 1e7),
# and no zero experts with YaRN (its softmax mscale; 90 + 32 tokens pass its original 64 positions)
VARIANTS = {
    'flash': dict(zero_expert_num=4, routed_scaling_factor=6.0),
    'no_zero_experts_yarn': dict(zero_expert_num=0, routed_scaling_factor=1.5, rope_parameters=YARN),
}


def longcat_config(**overrides) -> LongcatFlashConfig:
    """Two layers (four attention sublayers) of four heads over a latent of 32 (LongCat-Flash: 28 layers, 64 heads,
    512), a query projection of rank 48; the MoE of 8 experts (top 3) and, as the hub's, zero experts."""
    return LongcatFlashConfig(**{**dict(
        hidden_size=64, ffn_hidden_size=96, expert_ffn_hidden_size=32, num_layers=2, num_attention_heads=4,
        n_routed_experts=NUM_EXPERTS, moe_topk=3, kv_lora_rank=KV_LORA_RANK, q_lora_rank=48, qk_rope_head_dim=ROPE_DIM,
        head_dim=ROPE_DIM, qk_nope_head_dim=16, v_head_dim=16, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
        pad_token_id=None), **overrides})


def save_longcat(path: str, **overrides) -> str:
    """A tiny random LongCat-Flash saved with transformers; the routers' correction biases are random too."""
    return save_random_model(longcat_config(**overrides), path, std={'e_score_correction_bias': 0.1})


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def longcat(request, tmp_path_factory) -> str:
    return save_longcat(str(tmp_path_factory.mktemp(request.param)), **VARIANTS[request.param])


def test_greedy_and_first_logits_match_transformers(longcat):
    assert_matches_transformers(longcat, hf_causal_lm(longcat), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_bf16_within_twice_transformers_error(tmp_path):
    """bf16 on the CPU (packed projections and experts, the native latent-attention kernels, the scaled queries and
    latents in bf16): the last logits stay within twice the error of transformers' own bf16 model."""
    assert_bf16_within_twice_transformers(save_longcat(str(tmp_path / 'flash'), **VARIANTS['flash']))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(tmp_path):
    """On the hub's shape only (the other variant's layers batch alike)."""
    path = save_longcat(str(tmp_path / 'flash'), **VARIANTS['flash'])
    assert_batched_chunked_and_cached_equal_solo(path, prefix_sharing_prompts())


def test_two_latent_caches_a_layer_and_the_shortcut_moe_with_zero_experts(tmp_path):
    """Each layer attends over two of the engine's latent caches; the shortcut MoE gives transformers' output for
    tokens routed to zero experts, to real ones, and to both."""
    path = save_longcat(str(tmp_path / 'flash'), **VARIANTS['flash'])
    engine = make_engine(path)
    model = engine.runner.model
    assert len(model.layers) == 2 and len(engine.runner.kv_caches) == 4
    assert all(cache[0].shape[-1] == KV_LORA_RANK + ROPE_DIM for cache in engine.runner.kv_caches)
    moe, hf_moe = model.layers[0].mlp, hf_causal_lm(path).model.layers[0].mlp
    assert isinstance(moe, LongcatFlashMoE)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    zero_slots = (hf_moe.router(x)[2] >= NUM_EXPERTS).sum(-1)
    assert (zero_slots == 0).any() and (zero_slots > 0).any()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf_moe(x), rtol=1e-5, atol=1e-5)


def test_next_token_prediction_weights_are_not_loaded(tmp_path):
    """The hub's files carry a multi-token-prediction module (``model.mtp.*``: a dense layer of the same names and
    its projections), which transformers ignores: the engine skips it, its tokens those without it."""
    path = save_longcat(str(tmp_path / 'flash'), **VARIANTS['flash'])
    prompts = random_prompts([5, 40], seed=4)
    expected = run(make_engine(path), prompts)
    file = os.path.join(path, 'model.safetensors')
    tensors = load_file(file)
    mtp = {name.replace('model.layers.0.', 'model.mtp.layers.0.'): tensor.clone() for name, tensor in tensors.items()
           if name.startswith('model.layers.0.') and '.mlp.' not in name}
    mtp.update({'model.mtp.eh_proj.weight': torch.randn(64, 128), 'model.mtp.enorm.m.weight': torch.ones(64),
                'model.mtp.hnorm.m.weight': torch.ones(64), 'model.mtp.norm.m.weight': torch.ones(64)})
    save_file({**tensors, **mtp}, file, metadata={'format': 'pt'})
    assert run(make_engine(path), prompts) == expected


@pytest.mark.parametrize('overrides, message', [
    (dict(router_bias=True), 'router_bias'),
    (dict(zero_expert_type='zero'), 'zero_expert_type'),
    (dict(mla_scale_q_lora=False), 'mla_scale_q_lora'),
])
def test_options_transformers_does_not_run_are_refused(overrides, message):
    config = longcat_config(**VARIANTS['flash'])
    for name, value in overrides.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=message):
        check_config(config)


@pytest.mark.slow
def test_tp2_equals_tp1(tmp_path):
    """Each rank computes its own heads of every attention sublayer (their share of ``q_b_proj`` and ``kv_b_proj``),
    its share of both dense MLPs and of every expert; every rank adds the zero experts' share once, after the
    experts' sum."""
    assert_tp2_equals_tp1(save_longcat(str(tmp_path / 'flash'), **VARIANTS['flash']), random_prompts([5, 40], seed=8))


def test_longcat_tool_calls_and_picked_for_its_model_type():
    """LongCat-Flash writes Hermes' JSON calls in ``<longcat_tool_call>`` tags (vLLM's ``longcat`` parser); every
    chunking of the reply gives the same message. A checkpoint of model type ``longcat_flash`` gets the parser by
    default, and no reasoning parser (LongCat-Flash-Chat does not reason)."""
    make = lambda: ChoiceParser(None, get_tool_parser('longcat')())  # noqa: E731
    text = ('Let me check.\n<longcat_tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
            '</longcat_tool_call>\n<longcat_tool_call>\n{"name": "now", "arguments": {}}\n</longcat_tool_call>')
    assert split(make, text) == {'reasoning': '', 'content': 'Let me check.',
                                 'calls': [('get_weather', '{"city": "Zürich"}'), ('now', '{}')]}
    assert split(make, 'Plain <tool_call> text.')['content'] == 'Plain <tool_call> text.'
    assert MODEL_PARSERS['longcat_flash'] == ('longcat', None)
