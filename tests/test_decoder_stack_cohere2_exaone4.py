"""Cohere2 and EXAONE 4.0 in the native decoder stack against the layers' own forward: Cohere2's parallel blocks on a
weight-only LayerNorm (``parallel_block``, ``layer_norm``; sliding layers turning neighbouring pairs, NoPE full
layers, with and without attention biases), EXAONE 4.0's post-norms with per-head q/k norms (``post_norms_only``,
NoPE full layers); bf16 and W8A8 projections, KV caches in bf16, int8 and int4, 4-bit copies for small steps: every
step's hidden states equal, and each of Cohere2's options shown to count."""
from __future__ import annotations

import pytest
import torch
from helpers import random_prompts
from test_cohere2 import save_cohere2
from test_decoder_stack import (ENGINE, assert_stack_equals_the_layers, differences_without_an_option, saved_models,
                                small_int4_steps)
from test_exaone4 import save_exaone4

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.models import cohere2
from lmdeploy.pytorch.nn.decoder_stack import layer_weights

# kind -> (how to save it, its variant)
MODELS = {'cohere2': (save_cohere2, 'command_r7b'), 'cohere2_biased': (save_cohere2, 'biased_untied'),
          'exaone4': (save_exaone4, 'exaone4_32b')}
CASES = [(kind, 'bf16', 0) for kind in MODELS] + [('cohere2', 'w8a8', 8), ('exaone4', 'w8a8', 8),
                                                  ('cohere2', 'bf16', 4)]


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """A tiny random model of a kind, and its W8A8 copy, saved once per kind and weight kind."""
    return saved_models(tmp_path_factory, lambda kind, folder: MODELS[kind][0](folder, MODELS[kind][1]))


@pytest.mark.parametrize('kind,weights,quant_policy', CASES)
def test_stack_equals_the_layers(kind, weights, quant_policy, saved, native_gemms, monkeypatch):
    """Chunked prefills (48 tokens a step, prompts longer than the 16-token windows), mixed and decode steps."""
    assert_stack_equals_the_layers(saved(kind, weights), quant_policy, monkeypatch)


@pytest.mark.parametrize('kind', ['cohere2', 'exaone4'])
def test_small_int4_steps_run_in_the_stack(kind, saved, native_gemms, monkeypatch):
    """With ``decode_int4``, steps of at most two tokens run in the stack on the 4-bit weights, equal to the layers'
    forward on them."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    engine = Engine(saved(kind, 'bf16'), PytorchEngineConfig(decode_int4=True, **ENGINE), show_progress=False)
    stack = engine.runner.model.native_stack
    assert stack.small is not None and stack.small_step_rows == 2
    steps = small_int4_steps(engine, monkeypatch)
    assert (0, 1) in steps and (0, 3) in steps


@pytest.mark.parametrize('option', ['parallel_block', 'layer_norm'])
def test_cohere2_options_matter(option, saved, native_gemms, monkeypatch):
    """A stack built without one of Cohere2's options (``parallel_block``: Llama's sequential layer with a unit
    post-attention norm; ``layer_norm``: an RMSNorm for its input norm) gives other hidden states than the layers
    at every step, where the stack built with it gives theirs."""
    engine = Engine(saved('cohere2', 'bf16'), PytorchEngineConfig(**ENGINE), show_progress=False)

    def without_option(input_norm, post_norm, projections, small_step=False, **options):
        options[option] = False
        if option == 'parallel_block':
            post_norm = torch.ones_like(input_norm)
        return layer_weights(input_norm, post_norm, projections, small_step, **options)

    differences = differences_without_an_option(engine, monkeypatch, cohere2, without_option,
                                                random_prompts([20, 9], seed=4))
    print(f'cohere2 without {option}: hidden states differ by {min(differences):.3g} to {max(differences):.3g}')
    assert min(differences) > 0.01


def test_parallel_block_options_fit_together(native_gemms):
    """A parallel block has its input norm and no post-norm, output norms nor residual scale."""
    weight = torch.zeros(32, 16, dtype=torch.bfloat16)
    bf16 = native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_weight(weight))
    norm = torch.ones(16, dtype=torch.bfloat16)
    layer = dict(input_norm=norm, qkv=bf16, o=bf16, gate_up=bf16, down=bf16, rotary_dim=16, parallel_block=True,
                 layer_norm=True)
    stack = dict(num_heads=1, num_kv_heads=1, head_dim=16, eps=1e-5, scale=0.25, quant_policy=0)
    native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer)], **stack)
    for options, match in [(dict(post_norm=norm), 'no post_norm'), (dict(attn_out_norm=norm), 'output norms'),
                           (dict(residual_scale=0.5), 'nor residual_scale'),
                           (dict(input_norm=None), 'has its input_norm')]:
        with pytest.raises(RuntimeError, match=match):
            native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**{**layer, **options})], **stack)
