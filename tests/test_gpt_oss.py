"""gpt-oss against transformers on tiny random models saved by transformers: sinks, alternating sliding-window
(window 8, prompts far longer) and full layers, YaRN, the biased MoE with the clamped SwiGLU; greedy tokens
and first-step logits in fp32, batching, chunked prefill, prefix-cache hits; MXFP4 expert checkpoints."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, Mxfp4Config
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import assert_transformers_greedy, make_engine, random_prompts, run

from lmdeploy.pytorch.nn.quant.mxfp4 import dequantize_mxfp4

WINDOW = 8
CONFIG = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=VOCAB_SIZE, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=1024, tie_word_embeddings=False,
              rope_parameters={'rope_type': 'yarn', 'rope_theta': 150000.0, 'factor': 32.0, 'beta_fast': 32.0,
                               'beta_slow': 1.0, 'truncate': False, 'original_max_position_embeddings': 32})
EXPERT_TENSORS = ('gate_up_proj', 'down_proj')


def save_gpt_oss(path: str, **overrides) -> str:
    """A tiny random gpt-oss (``CONFIG`` with ``overrides``) saved with transformers; the experts' gate_up
    weights large enough that the SwiGLU's clamps bite (on 10-25% of the features)."""
    config = GptOssConfig(**CONFIG | overrides)
    assert config.layer_types == ['sliding_attention', 'full_attention'] * 2
    return save_random_model(config, path, std={'gate_up_proj': 4.0})


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N]`` -> blocks ``[..., N / 32, 16]`` and scales ``[..., N / 32]``: per block of 32 the
    smallest power of two that brings its largest magnitude within 6, then the nearest e2m1 value."""
    blocks = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-100) / 6)).clamp(-127, 127)
    values = torch.tensor(FP4_VALUES)
    codes = (blocks / torch.exp2(exponent)[..., None]).unsqueeze(-1).sub(values).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def save_mxfp4(dense: str, path: str) -> str:
    """``dense``'s checkpoint with its experts' weights in MXFP4, as OpenAI's gpt-oss checkpoints hold them."""
    os.makedirs(path)
    tensors = {}
    for name, tensor in load_file(os.path.join(dense, 'model.safetensors')).items():
        if name.endswith(EXPERT_TENSORS):
            tensors[f'{name}_blocks'], tensors[f'{name}_scales'] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            tensors[name] = tensor
    save_file(tensors, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
    for name in os.listdir(dense):
        if not name.endswith('.safetensors'):
            with open(os.path.join(dense, name), 'rb') as src, open(os.path.join(path, name), 'wb') as dst:
                dst.write(src.read())
    with open(os.path.join(path, 'config.json')) as f:
        config = json.load(f)
    config['quantization_config'] = {'quant_method': 'mxfp4', 'modules_to_not_convert': [
        'model.layers.*.self_attn', 'model.layers.*.mlp.router', 'model.embed_tokens', 'lm_head']}
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope='module')
def model_path(tmp_path_factory) -> str:
    return save_gpt_oss(str(tmp_path_factory.mktemp('gpt_oss')))


@pytest.fixture(scope='module')
def hf_model(model_path):
    return hf_causal_lm(model_path)


def test_greedy_and_first_logits_match_transformers(model_path, hf_model):
    assert_matches_transformers(model_path, hf_model, random_prompts([3, 17, 40, 75], seed=1),
                                random_prompts([7, 31, 60], seed=2))


def test_batched_chunked_and_cached_equal_solo(model_path):
    assert_batched_chunked_and_cached_equal_solo(model_path, prefix_sharing_prompts((50, 70), 32, (12, 21)),
                                                 chunked={'max_prefill_token_num': 8, 'block_size': 8})


def test_mxfp4_dequantization_matches_transformers():
    """Every code and a spread of exponents, against transformers' own dequantization."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 40, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert ours.shape == (3, 40, 128)
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    weight = torch.randn(2, 8, 64, generator=g)
    roundtrip = dequantize_mxfp4(*quantize_mxfp4(weight), torch.float32)
    assert (roundtrip - weight).abs().max() < 0.25 * weight.abs().max()


def test_mxfp4_checkpoint_matches_transformers(model_path, tmp_path):
    """An MXFP4 checkpoint loads with its experts dequantized: the tokens of transformers' dequantizing load."""
    path = save_mxfp4(model_path, str(tmp_path / 'mxfp4'))
    hf = hf_causal_lm(path, quantization_config=Mxfp4Config(dequantize=True))
    prompts = random_prompts([5, 45], seed=5)
    assert_transformers_greedy(hf, prompts, run(make_engine(path), prompts))


def test_tp2_equals_tp1(model_path):
    """Each rank holds its heads' sinks and its share of every expert's features and gate/up biases; the
    down bias is added once."""
    assert_tp2_equals_tp1(model_path, random_prompts([5, 30], seed=6))
