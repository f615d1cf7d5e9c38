"""LFM2 (``Lfm2ForCausalLM``) and LFM2-MoE (``Lfm2MoeForCausalLM``: gated short convolutions between attention
layers) against transformers on tiny random models: greedy tokens and first-step logits in fp32, every position's
logits over chunked prefill, batching, chunked prefill and preemption equal to solo runs with the convolution-state
slots given back, fp32 batch invariance, prefix caching turned off, tensor parallelism refused, the hub's expert
names, and LFM2's tool calls (``--tool-call-parser lfm2``)."""
from __future__ import annotations

import os
import sys

import pytest
from safetensors.torch import load_file, save_file
from transformers import Lfm2Config, Lfm2MoeConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_matches_transformers, assert_prefix_caching_off_and_every_logit_matches,
                           assert_slots_free, hf_causal_lm)
from helpers import make_engine, random_prompts, run
from parser_checks import split

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run as arrivals  # noqa: E402

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE,
             max_position_embeddings=1024, pad_token_id=None)
VARIANTS = {
    # LFM2's MLP width from ``block_auto_adjust_ff_dim`` (two thirds of 144, rounded up to a multiple of 40: 120),
    # convolutions of 3 taps (the released checkpoints'), the LM head tied to the embeddings
    'lfm2': lambda: Lfm2Config(num_hidden_layers=4, layer_types=['conv', 'full_attention', 'conv', 'conv'],
                               intermediate_size=144, block_ffn_dim_multiplier=1.0, block_multiple_of=40,
                               conv_L_cache=3, tie_word_embeddings=True, architectures=['Lfm2ForCausalLM'], **SHAPE),
    # one dense layer, then experts routed by sigmoid scores plus a bias; convolutions of 4 taps with biases
    'lfm2_moe': lambda: Lfm2MoeConfig(num_hidden_layers=4, layer_types=['conv', 'conv', 'full_attention', 'conv'],
                                      intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                      num_experts_per_tok=3, num_dense_layers=1, routed_scaling_factor=1.5,
                                      conv_L_cache=4, conv_bias=True, tie_word_embeddings=False,
                                      architectures=['Lfm2MoeForCausalLM'], **SHAPE),
}
STD = {'expert_bias': 0.3}  # transformers starts the expert bias at zeros: a random one routes other experts


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def lfm2_model(request, tmp_path_factory) -> str:
    return save_random_model(VARIANTS[request.param](), str(tmp_path_factory.mktemp(request.param)), std=STD)


@pytest.fixture(scope='module')
def lfm2_moe(tmp_path_factory) -> str:
    return save_random_model(VARIANTS['lfm2_moe'](), str(tmp_path_factory.mktemp('lfm2_moe')), std=STD)


def test_greedy_and_first_logits_match_transformers(lfm2_model):
    assert_matches_transformers(lfm2_model, hf_causal_lm(lfm2_model), random_prompts([1, 2, 17, 70, 150]),
                                random_prompts([3, 33, 100], seed=1))


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(lfm2_moe):
    """The convolution states carry over between prefill chunks (of 16 tokens, and of 2 on the shorter prompts:
    chunks shorter than the state) and a preempted sequence recomputes them from zero."""
    prompts = random_prompts([70, 100, 20, 45], seed=3)
    plain = run(make_engine(lfm2_moe), prompts)
    assert [run(make_engine(lfm2_moe), [p])[0] for p in prompts] == plain
    for chunk, block_size, few in ((16, 16, 4), (2, 2, 2)):  # chunks of 2 on the two shorter prompts: fewer steps
        engine = make_engine(lfm2_moe, max_prefill_token_num=chunk, block_size=block_size, max_batch_size=4,
                             num_gpu_blocks=2048 // block_size)
        assert run(engine, prompts[-few:]) == plain[-few:]
        assert_slots_free(engine)
    tight = make_engine(lfm2_moe, num_gpu_blocks=14)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_fp32_is_batch_invariant(lfm2_moe, native):
    """fp32 tokens and logprobs bitwise: prompts of up to 200 tokens in prefill chunks of at most 100 (cut
    anywhere: the convolution does not round by chunks), alone and arriving one a step beside the others'
    decode rows."""
    if cpu.fp32_gemm() is None:
        pytest.skip('the native fp32 GEMM needs AVX-512')
    engine = Engine(lfm2_moe, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16,
                                                  max_batch_size=4, max_prefill_token_num=100), show_progress=False)
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)
    prompts = random_prompts([2, 9, 40, 140, 200], seed=11)
    alone = [arrivals(engine, [prompt], config, 0)[0] for prompt in prompts]
    assert arrivals(engine, prompts, config, 0) == alone
    assert arrivals(engine, prompts, config, 1) == alone


def test_get_logits_and_prefix_caching_off(lfm2_moe, caplog):
    """Every position's logits equal transformers' (computed in chunks of 16, the states carried over); the
    convolution layers take recurrent-state slots, not KV blocks; prefix caching, asked for, is off."""
    engine = assert_prefix_caching_off_and_every_logit_matches(lfm2_moe, caplog)
    assert engine.runner.cfg.num_state_layers == 3


def test_tensor_parallelism_is_refused(lfm2_moe):
    with pytest.raises(ValueError, match='short-convolution layers are not sharded for tensor parallelism; use tp=1'):
        make_engine(lfm2_moe, tp=2)


def test_hub_expert_names(lfm2_moe, tmp_path):
    """The hub's LFM2-8B-A1B files hold each expert's ``w1``/``w3``/``w2`` (transformers 5 saves them stacked):
    the same model, the same tokens."""
    hub = tmp_path / 'hub'
    hub.mkdir()
    for name in os.listdir(lfm2_moe):
        if name != 'model.safetensors':
            (hub / name).symlink_to(os.path.join(lfm2_moe, name))
    tensors = {}
    for name, tensor in load_file(os.path.join(lfm2_moe, 'model.safetensors')).items():
        if name.endswith('experts.gate_up_proj'):
            for expert, (w1, w3) in enumerate(zip(*tensor.chunk(2, dim=1))):
                tensors[name.replace('gate_up_proj', f'{expert}.w1.weight')] = w1.contiguous()
                tensors[name.replace('gate_up_proj', f'{expert}.w3.weight')] = w3.contiguous()
        elif name.endswith('experts.down_proj'):
            for expert, w2 in enumerate(tensor):
                tensors[name.replace('down_proj', f'{expert}.w2.weight')] = w2.contiguous()
        else:
            tensors[name] = tensor
    assert any(name.endswith('experts.7.w2.weight') for name in tensors)
    save_file(tensors, str(hub / 'model.safetensors'), metadata={'format': 'pt'})
    prompts = random_prompts([9, 70], seed=4)
    assert run(make_engine(str(hub)), prompts) == run(make_engine(lfm2_moe), prompts)


@pytest.mark.parametrize('text, content, calls', [
    ('<|tool_call_start|>[get_weather(city="Paris", days=3), now()]<|tool_call_end|>', '',
     [('get_weather', '{"city": "Paris", "days": 3}'), ('now', '{}')]),
    ('Let me check. <|tool_call_start|>[f(a=[1, "x"])]<|tool_call_end|> Done.', 'Let me check. Done.',
     [('f', '{"a": [1, "x"]}')]),
    ('<|python_start|>[f(a=1)]<|python_end|>', '<|python_start|>[f(a=1)]<|python_end|>', []),
    ('see [f(a=1)] mid-line', 'see [f(a=1)] mid-line', []),
])
def test_lfm2_tool_parser(text, content, calls):
    """LFM2's calls: the pythonic list between ``<|tool_call_start|>`` and ``<|tool_call_end|>``, both dropped
    (Llama 4's ``<|python_start|>`` is text here)."""
    parser = get_tool_parser('lfm2')
    assert split(lambda: ChoiceParser(None, parser()), text) == {'reasoning': '', 'content': content, 'calls': calls}


def test_lfm2_tool_parser_with_special_markers():
    """As served with LFM2's tokenizer, whose markers are special tokens: a start marker that no list follows is
    left out of the text, as the reply would show it without a parser."""
    markers = ['<|tool_call_start|>', '<|tool_call_end|>']
    parser = get_tool_parser('lfm2')

    def split_text(text: str) -> dict:
        return split(lambda: ChoiceParser(None, parser((), markers), special_markers=markers), text)

    assert split_text('Hi <|tool_call_start|> no list') == {'reasoning': '', 'content': 'Hi  no list', 'calls': []}
    assert split_text('<|tool_call_start|>[f(a=1), g(b="x")]<|tool_call_end|>\nok') == {
        'reasoning': '', 'content': '\nok', 'calls': [('f', '{"a": 1}'), ('g', '{"b": "x"}')]}
