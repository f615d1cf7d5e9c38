"""Hunyuan-A13B, the dense Hunyuan, Arcee, Apertus and StarCoder2 in the native decoder stack against the layers' own
forward:
Hunyuan's q/k norms after the rotary (``qk_norm_after_rope``) and Hunyuan-A13B's MoE (softmax-routed on the fp32
router, the ungated shared MLP) as a ``MoEBlock``; Arcee's ungated ReLU² MLP and Apertus's ungated xIELU one with
each layer's coefficients and StarCoder2's ungated GELU-tanh one under biased LayerNorms (``ungated_mlp``,
``layer_norm`` with ``input_norm_bias`` and ``post_norm_bias``); bf16 and W8A8 projections, KV caches in bf16, int8 and int4, 4-bit
copies for small steps: every step's hidden states equal, Hunyuan's option shown to count, each prompt's tokens
alone as in a batch."""
from __future__ import annotations

import pytest
import torch
from conftest import save_random_model
from helpers import random_prompts
from test_apertus import apertus_config
from test_arcee import save_arcee
from test_batch_invariance import assert_batch_invariant
from test_decoder_stack import (ENGINE, assert_small_int4_steps_run_in_the_stack, assert_stack_equals_the_layers,
                                differences_without_an_option, saved_models)
from test_hunyuan import hunyuan_config
from test_hunyuan_dense import hunyuan_dense_config
from test_starcoder2 import save_starcoder2

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.models import llama
from lmdeploy.pytorch.nn.decoder_stack import layer_weights

# kind -> how to save a tiny random model of it
MODELS = {'hunyuan': lambda path: save_random_model(hunyuan_config(), path),
          'hunyuan_dense': lambda path: save_random_model(hunyuan_dense_config(), path),
          'arcee': lambda path: save_arcee(path, 'afm_yarn'),
          'arcee_biased': lambda path: save_arcee(path, 'biased'),
          'apertus': lambda path: save_random_model(apertus_config(), path),
          'starcoder2': lambda path: save_starcoder2(path, 'sliding')}
CASES = [(kind, 'bf16', 0) for kind in MODELS] + [('arcee', 'w8a8', 8), ('apertus', 'w8a8', 8),
                                                  ('hunyuan_dense', 'w8a8', 8), ('hunyuan', 'bf16', 4),
                                                  ('apertus', 'bf16', 8), ('starcoder2', 'bf16', 4)]


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """A tiny random model of a kind, and its W8A8 copy, saved once per kind and weight kind."""
    return saved_models(tmp_path_factory, lambda kind, folder: MODELS[kind](folder))


@pytest.mark.parametrize('kind,weights,quant_policy', CASES)
def test_stack_equals_the_layers(kind, weights, quant_policy, saved, native_gemms, monkeypatch):
    """Chunked prefills (48 tokens a step), mixed and decode steps."""
    assert_stack_equals_the_layers(saved(kind, weights), quant_policy, monkeypatch)


@pytest.mark.parametrize('kind', ['hunyuan', 'arcee', 'apertus', 'starcoder2'])
def test_small_int4_steps_run_in_the_stack(kind, saved, native_gemms, monkeypatch):
    """With ``decode_int4``, steps of at most two tokens run in the stack on the 4-bit weights (an ungated MLP's up
    projection on its bf16 one, as in the layers), equal to the layers' forward on them."""
    assert_small_int4_steps_run_in_the_stack(saved(kind, 'bf16'), monkeypatch)


def test_hunyuan_qk_norm_after_rope_matters(saved, native_gemms, monkeypatch):
    """A stack whose q/k norms apply before the rotary (without ``qk_norm_after_rope``) gives other hidden states
    than Hunyuan's layers at every step, where the stack built with it gives theirs."""
    engine = Engine(saved('hunyuan', 'bf16'), PytorchEngineConfig(**ENGINE), show_progress=False)

    def without_option(input_norm, post_norm, projections, small_step=False, **options):
        options['qk_norm_after_rope'] = False
        return layer_weights(input_norm, post_norm, projections, small_step, **options)

    differences = differences_without_an_option(engine, monkeypatch, llama, without_option,
                                                random_prompts([20, 9], seed=4))
    print(f'hunyuan without qk_norm_after_rope: hidden states differ by {min(differences):.3g} to '
          f'{max(differences):.3g}')
    assert min(differences) > 0.01


@pytest.mark.parametrize('kind', ['hunyuan', 'arcee', 'apertus', 'starcoder2'])
def test_stack_is_batch_invariant(kind, saved, native_gemms):
    """bf16 in the stack: each prompt's greedy tokens alone equal its tokens prefilled together and beside decode
    rows."""
    engine = Engine(saved(kind, 'bf16'), PytorchEngineConfig(**ENGINE), show_progress=False)
    assert engine.runner.model.native_stack is not None
    assert_batch_invariant(engine, random_prompts([1, 5, 17, 40], seed=3))


def test_ungated_mlp_options_fit_together(native_gemms):
    """An ungated MLP is ``relu2``, ``gelu_tanh`` or ``xielu``, only ``xielu`` with its four coefficients, and not
    with a gated GeLU one; the q/k norms after the rotary need the norms; only LayerNorms have biases."""
    weight = torch.zeros(32, 16, dtype=torch.bfloat16)
    bf16 = native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_weight(weight))
    norm = torch.ones(16, dtype=torch.bfloat16)
    coefficients = [torch.ones(1, dtype=torch.bfloat16)] * 2 + [torch.tensor(0.5), torch.tensor(-1e-6)]
    layer = dict(input_norm=norm, post_norm=norm, qkv=bf16, o=bf16, gate_up=bf16, down=bf16, rotary_dim=16)
    stack = dict(num_heads=1, num_kv_heads=1, head_dim=16, eps=1e-5, scale=0.25, quant_policy=0)
    for options in [dict(ungated_mlp='relu2'), dict(ungated_mlp='xielu', xielu=coefficients),
                    dict(ungated_mlp='gelu_tanh', layer_norm=True, input_norm_bias=norm, post_norm_bias=norm),
                    dict(q_norm=norm, k_norm=norm, qk_norm_after_rope=True)]:
        native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, **options)], **stack)
    for options, match in [(dict(ungated_mlp='gelu'), "'relu2', 'gelu_tanh' or 'xielu'"),
                           (dict(post_norm_bias=norm), "only a layer_norm layer's norms have biases"),
                           (dict(ungated_mlp='relu2', gelu_tanh_mlp=True), 'without gelu_tanh_mlp'),
                           (dict(ungated_mlp='xielu'), 'xielu coefficients'),
                           (dict(ungated_mlp='relu2', xielu=coefficients), 'xielu coefficients'),
                           (dict(ungated_mlp='xielu', xielu=coefficients[:3]), 'xielu coefficients'),
                           (dict(qk_norm_after_rope=True), 'needs the q and k norms')]:
        with pytest.raises(RuntimeError, match=match):
            native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, **options)], **stack)
