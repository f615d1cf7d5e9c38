"""GLM-5 (``GlmMoeDsaForCausalLM``: DeepSeek Sparse Attention with the indexer's rotary features in neighbouring
pairs, and ``shared`` layers reusing the last full layer's selection) against transformers on tiny random models
whose ``index_topk`` (8) is well below the test contexts: greedy tokens and first-step logits in fp32, batching,
chunked prefill, prefix-cache hits, and that the shared layers reuse the selection."""
from __future__ import annotations

import pytest
from transformers import GlmMoeDsaConfig

from conftest import save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           hf_causal_lm, prefix_sharing_prompts)
from helpers import make_engine, random_prompts
from test_deepseek_v32 import dsa_shape

INDEXER_TYPES = ['full', 'shared', 'full', 'shared']


@pytest.fixture(scope='module')
def glm5(tmp_path_factory) -> str:
    config = GlmMoeDsaConfig(**dsa_shape(num_hidden_layers=4, n_group=1, topk_group=1, rms_norm_eps=1e-5,
                                         rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0}),
                             indexer_types=INDEXER_TYPES)
    return save_random_model(config, str(tmp_path_factory.mktemp('glm5')), std={'e_score_correction_bias': 0.1})


def test_greedy_and_first_logits_match_transformers(glm5):
    assert_matches_transformers(glm5, hf_causal_lm(glm5), random_prompts([5, 17, 40, 90]), random_prompts([7, 31, 60]))


def test_shared_layers_have_no_indexer(glm5):
    layers = make_engine(glm5).runner.model.layers
    assert [layer.self_attn.indexer is not None for layer in layers] == [kind == 'full' for kind in INDEXER_TYPES]


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(glm5):
    assert_batched_chunked_and_cached_equal_solo(glm5, prefix_sharing_prompts())
