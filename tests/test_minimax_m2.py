"""MiniMax-M2 (``MiniMaxM2ForCausalLM``) against transformers on tiny random models saved by transformers: greedy
tokens and first-step logits in fp32, batching, chunked prefill and prefix-cache hits, the router's correction
bias, tensor parallelism (the q/k norms over every rank's heads), an FP8 block-scaled checkpoint (as the hub's) and
bf16 in the native decoder stack."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file
from transformers import MiniMaxM2Config

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_native_stack_gives_the_layers_tokens, assert_tp2_equals_tp1, hf_causal_lm,
                           prefix_sharing_prompts)
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_deepseek import FP8_BLOCK, dequantize_blockwise, quantize_blockwise



def minimax_m2_config(**overrides) -> MiniMaxM2Config:
    """Four query heads and two key/value heads of 24 features, 8 of them rotating (MiniMax-M2's ``rotary_dim``
    64 of 128), over a hidden size of 64; two layers of 8 experts, top 2. ``use_qk_norm`` as the hub's
    config.json has it (transformers does not read it: the norms are always there), and a ``sliding_window`` that
    transformers' MiniMax-M2 ignores too (its attention is full): the prompts pass it."""
    return MiniMaxM2Config(**{**dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=24, rotary_dim=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                                     use_qk_norm=True, sliding_window=16), **overrides})


@pytest.fixture(scope='module')
def minimax_m2(tmp_path_factory) -> str:
    """A tiny random MiniMax-M2; the routers' correction biases are random, large enough to change choices."""
    return save_random_model(minimax_m2_config(), str(tmp_path_factory.mktemp('minimax_m2')),
                             std={'e_score_correction_bias': 0.3})


def test_config_is_minimax_m2s_layout():
    config = minimax_m2_config()
    assert config.rope_parameters['partial_rotary_factor'] == 8 / 24
    assert config.num_attention_heads * config.head_dim != config.hidden_size


def test_greedy_and_first_logits_match_transformers(minimax_m2):
    assert_matches_transformers(minimax_m2, hf_causal_lm(minimax_m2), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(minimax_m2):
    assert_batched_chunked_and_cached_equal_solo(minimax_m2, prefix_sharing_prompts())


def test_correction_bias_is_loaded_and_routes(minimax_m2):
    """The checkpoint's ``block_sparse_moe.e_score_correction_bias`` reaches each layer's router, and it changes
    the tokens: with the biases zeroed the engine's tokens differ."""
    engine = make_engine(minimax_m2)
    hf_model = hf_causal_lm(minimax_m2)
    for layer, hf_layer in zip(engine.runner.model.layers, hf_model.model.layers):
        assert layer.mlp.gate.e_score_correction_bias.equal(hf_layer.mlp.e_score_correction_bias)
    prompts = random_prompts([20, 45], seed=5)
    outs = run(engine, prompts)
    for layer in engine.runner.model.layers:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert run(engine, prompts) != outs


@pytest.mark.parametrize('kv_heads', [2, 1])
def test_tp2_equals_tp1(kv_heads, minimax_m2, tmp_path):
    """Each rank norms its own heads' queries and keys by the sums of squares of every rank's heads (one all-reduce
    of ``[tokens, 2]`` a layer), and computes its share of every expert; with one KV head both ranks hold it and
    only the first one's squares count. Tokens and logits as one rank's."""
    path = minimax_m2 if kv_heads == 2 else save_random_model(minimax_m2_config(num_key_value_heads=1),
                                                              str(tmp_path / 'one_kv_head'))
    assert_tp2_equals_tp1(path, random_prompts([5, 40], seed=8), logits=True)


def test_bf16_native_stack_gives_the_layers_tokens(minimax_m2, native_gemms):
    """bf16 on the native GEMMs: every layer runs in the native decoder stack (q/k norms across heads, the MoE
    layers as ``MoEBlock``s routed ``noaux_tc``), with the tokens of the layers' own forward."""
    assert_native_stack_gives_the_layers_tokens(minimax_m2)


def test_fp8_block_scaled_checkpoint_is_dequantized_at_load(minimax_m2, tmp_path):
    """The hub's MiniMax-M2 is FP8 (e4m3, block scales as ``weight_scale_inv``): every projection and expert
    quantized so here gives transformers' tokens on the same weights dequantized independently."""
    tensors = load_file(os.path.join(minimax_m2, 'model.safetensors'))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.startswith('model.layers.') and name.endswith(('proj.weight', 'w1.weight', 'w2.weight', 'w3.weight')):
            codes, scales = quantize_blockwise(tensor, FP8_BLOCK)
            quantized[name], quantized[f'{name}_scale_inv'] = codes, scales
            dequantized[name] = dequantize_blockwise(codes, scales, FP8_BLOCK)
        else:
            quantized[name] = dequantized[name] = tensor
    assert len(quantized) == len(tensors) + 2 * (4 + 3 * 8)  # each layer's q/k/v/o and its experts' w1/w2/w3
    folders = {'fp8': quantized, 'dense': dequantized}
    for kind, weights in folders.items():
        shutil.copytree(minimax_m2, tmp_path / kind)
        save_file(weights, str(tmp_path / kind / 'model.safetensors'), metadata={'format': 'pt'})
    config = json.loads((tmp_path / 'fp8' / 'config.json').read_text())
    config['quantization_config'] = {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
                                     'weight_block_size': FP8_BLOCK}
    (tmp_path / 'fp8' / 'config.json').write_text(json.dumps(config))
    prompts = random_prompts([5, 40], seed=11)
    assert_transformers_greedy(hf_causal_lm(str(tmp_path / 'dense')), prompts,
                               run(make_engine(str(tmp_path / 'fp8')), prompts))
