"""StarCoder2 (``Starcoder2ForCausalLM``) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32 (biased LayerNorms and projections, the ungated GELU-tanh ``c_fc``/``c_proj``
MLP, tied embeddings as the 3B's; a sliding window shorter than the prompts, or none), batching, chunked prefill and
prefix-cache hits, tensor parallelism, and bf16 in the native decoder stack close to transformers."""
from __future__ import annotations

import pytest
from transformers import Starcoder2Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_first_logits_close,
                           assert_matches_transformers, assert_tp2_equals_tp1, hf_causal_lm, hf_last_logits,
                           prefix_sharing_prompts)
from helpers import random_prompts, run

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

# name -> config overrides: a window of 16 positions (the prompts reach 130), and full attention untied from the
# embeddings (as the 15B's)
VARIANTS = {'sliding': dict(sliding_window=16), 'full_untied': dict(tie_word_embeddings=False)}


def starcoder2_config(**overrides) -> Starcoder2Config:
    """Two layers of four query heads and two KV heads of 16 features over a hidden size of 64."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=1024)
    return Starcoder2Config(**{**shape, **overrides})


def save_starcoder2(path: str, variant: str) -> str:
    return save_random_model(starcoder2_config(**VARIANTS[variant]), path)


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def starcoder2(request, tmp_path_factory) -> str:
    return save_starcoder2(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_config_is_starcoder2s_layout():
    config = starcoder2_config()
    assert config.use_bias and config.hidden_act == 'gelu_pytorch_tanh' and config.tie_word_embeddings


def test_greedy_and_first_logits_match_transformers(starcoder2):
    assert_matches_transformers(starcoder2, hf_causal_lm(starcoder2), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(tmp_path):
    """With the window shorter than the prompts: chunks and cached blocks the window has left behind."""
    assert_batched_chunked_and_cached_equal_solo(save_starcoder2(str(tmp_path / 'starcoder2'), 'sliding'),
                                                 prefix_sharing_prompts())


def test_bf16_runs_its_layers_in_the_native_stack(tmp_path, native_gemms):
    """With bf16 on the native GEMMs the layers run in the stack (biased LayerNorms, the ungated GELU-tanh MLP),
    batched as solo, the first step's logits within bf16's error of transformers in fp32."""
    path = save_starcoder2(str(tmp_path / 'starcoder2'), 'sliding')
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16), show_progress=False)
    assert engine.runner.model.native_stack is not None
    prompts = random_prompts([40, 9, 23], seed=6)
    outs = run(engine, prompts)
    assert [run(engine, [prompt])[0] for prompt in prompts] == outs
    hf_model = hf_causal_lm(path)
    assert_first_logits_close(engine, prompts, [hf_last_logits(hf_model, p) for p in prompts], tol=0.05,
                              relative=True)


@pytest.mark.slow
def test_tp2_equals_tp1(tmp_path):
    """Each rank computes its own heads (and their biases) and its share of the MLP's features; the LayerNorms are
    every rank's."""
    assert_tp2_equals_tp1(save_starcoder2(str(tmp_path / 'starcoder2'), 'sliding'), random_prompts([5, 40], seed=8))
