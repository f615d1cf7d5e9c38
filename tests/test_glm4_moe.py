"""GLM-4.5 (``Glm4MoeForCausalLM``) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32, batching, chunked prefill and prefix-cache hits, tensor parallelism,
the next-token-prediction layer left unused, and bf16 on the CPU (in the native decoder stack on its GEMMs)."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_first_logits_close,
                           assert_matches_transformers, assert_native_stack_gives_the_layers_tokens,
                           assert_tp2_equals_tp1, hf_causal_lm, hf_last_logits, prefix_sharing_prompts)
from helpers import make_engine, random_prompts, run

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

# name -> config overrides: GLM-4.5's shape (q/k norms off, attention biases) and GLM-4.5-Air's (one group,
# q/k norms, no biases)
VARIANTS = {
    'glm45': dict(use_qk_norm=False, attention_bias=True, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    'glm45_air_qk_norm': dict(use_qk_norm=True, attention_bias=False, n_group=1, topk_group=1,
                              routed_scaling_factor=1.0),
}


def glm4_moe_config(**overrides) -> Glm4MoeConfig:
    """Four heads of 16 features (half of them rotating) over a hidden size of 48, not ``heads * head_dim``
    (GLM-4.5's 96 heads of 128 over 5,120), one dense layer, then two MoE layers of 8 experts."""
    return Glm4MoeConfig(hidden_size=48, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1,
                         n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                         vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=False,
                         pad_token_id=None, **overrides)


def save_glm4_moe(path: str, **overrides) -> str:
    """A tiny random GLM-4.5 saved with transformers; the routers' correction biases are random too."""
    return save_random_model(glm4_moe_config(**overrides), path, std={'e_score_correction_bias': 0.1})


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def glm4_moe(request, tmp_path_factory) -> str:
    return save_glm4_moe(str(tmp_path_factory.mktemp(request.param)), **VARIANTS[request.param])


def test_config_is_glm45s_layout():
    config = glm4_moe_config()
    assert config.rope_parameters['partial_rotary_factor'] == 0.5
    assert config.num_attention_heads * config.head_dim != config.hidden_size


def test_greedy_and_first_logits_match_transformers(glm4_moe):
    assert_matches_transformers(glm4_moe, hf_causal_lm(glm4_moe), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(glm4_moe):
    assert_batched_chunked_and_cached_equal_solo(glm4_moe, prefix_sharing_prompts())


def test_bf16_close_to_transformers(glm4_moe):
    """bf16 on the CPU's default GEMMs (oneDNN on AMX CPUs, where the layers run their own forward): the logits stay
    within bf16's error of transformers in fp32."""
    engine = Engine(glm4_moe, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    hf_model = hf_causal_lm(glm4_moe)
    prompts = random_prompts([7, 31, 60], seed=2)
    assert_first_logits_close(engine, prompts, [hf_last_logits(hf_model, p) for p in prompts], tol=0.05,
                              relative=True)


def test_bf16_native_stack_gives_the_layers_tokens(glm4_moe, native_gemms):
    """bf16 on the native GEMMs: every layer runs in the native decoder stack (its MoE layers as ``MoEBlock``s with
    DeepSeek-V3's routing; ``tests/test_decoder_stack_moe.py`` compares every step), with the tokens of the layers'
    own forward."""
    assert_native_stack_gives_the_layers_tokens(glm4_moe)


def assert_mtp_layer_is_skipped(path: str, hidden: int) -> None:
    """A three-layer checkpoint at ``path`` given a next-token-prediction layer 3 (layer 2's tensors plus
    ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.norm`` of ``hidden`` features), as GLM's files carry it: the
    engine skips it, its tokens those without it."""
    prompts = random_prompts([5, 40], seed=4)
    expected = run(make_engine(path), prompts)
    file = os.path.join(path, 'model.safetensors')
    tensors = load_file(file)
    mtp = {name.replace('layers.2.', 'layers.3.'): tensor.clone() for name, tensor in tensors.items()
           if name.startswith('model.layers.2.')}
    mtp.update({'model.layers.3.eh_proj.weight': torch.randn(hidden, 2 * hidden),
                'model.layers.3.enorm.weight': torch.ones(hidden), 'model.layers.3.hnorm.weight': torch.ones(hidden),
                'model.layers.3.shared_head.norm.weight': torch.ones(hidden)})
    save_file({**tensors, **mtp}, file, metadata={'format': 'pt'})
    engine = make_engine(path)
    assert len(engine.runner.model.layers) == 3
    assert run(engine, prompts) == expected


def test_next_token_prediction_layer_is_not_loaded(tmp_path):
    """The checkpoint's layer ``num_hidden_layers`` (the MTP layer, as GLM-4.5's files carry it) is skipped."""
    assert_mtp_layer_is_skipped(save_glm4_moe(str(tmp_path / 'glm'), **VARIANTS['glm45']), 48)


def test_tp2_equals_tp1(tmp_path):
    """Each rank computes its own heads and its share of every expert and of the shared expert."""
    assert_tp2_equals_tp1(save_glm4_moe(str(tmp_path / 'glm'), **VARIANTS['glm45']), random_prompts([5, 40], seed=8))
