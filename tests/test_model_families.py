"""Phi-3, GLM, GLM-4, SmolLM3 and Mistral against transformers on tiny random models saved by transformers:
greedy tokens and first-step logits in fp32, batching, chunked prefill and prefix-cache hits."""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, Glm4Config, GlmConfig, MistralConfig, Phi3Config,
                          SmolLM3Config)

from conftest import VOCAB_SIZE, build_tokenizer
from helpers import GREEDY_32, hf_greedy, make_engine, random_prompts, run

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=None)
LONGROPE = {'rope_type': 'longrope', 'rope_theta': 10000.0, 'original_max_position_embeddings': 48,
            'long_factor': [1.0, 1.4, 2.2, 3.6, 6.0, 9.0], 'short_factor': [1.0, 1.1, 1.2, 1.4, 1.7, 2.0],
            'partial_rotary_factor': 0.75}
FAMILIES = {
    'phi3': lambda: Phi3Config(**SHAPE),
    # Phi-4-mini's shape: LongRoPE over 3/4 of each head; the longer prompts take its long factors
    'phi3_longrope': lambda: Phi3Config(**SHAPE, original_max_position_embeddings=48, rope_parameters=LONGROPE),
    'glm': lambda: GlmConfig(**SHAPE, head_dim=16),
    'glm4': lambda: Glm4Config(**SHAPE, head_dim=16),
    'smollm3': lambda: SmolLM3Config(**{**SHAPE, 'num_hidden_layers': 4}, no_rope_layer_interval=4),
    'mistral': lambda: MistralConfig(**SHAPE, head_dim=16, sliding_window=None),
}
# families the native decoder stack runs on the CPU (plain Llama layers)
NATIVE_STACK = {'phi3', 'mistral'}


def save_family(kind: str, path: str, max_shard_size: str = '50GB', **overrides) -> str:
    """A tiny random model of ``kind`` saved with transformers (sharded below ``max_shard_size``)."""
    torch.manual_seed(0)
    config = FAMILIES[kind]()
    for name, value in overrides.items():
        setattr(config, name, value)
    tokenizer = build_tokenizer()
    config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope='module', params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, save_family(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def hf_model(family):
    return AutoModelForCausalLM.from_pretrained(family[1], dtype=torch.float32).eval()


def test_greedy_and_first_logits_match_transformers(family, hf_model):
    engine = make_engine(family[1])
    # LongRoPE: transformers' generate turns a sequence again when decoding crosses the switch; the engine
    # keeps what it cached, so no output here crosses it (prompts of 3 + 32 and 17 + 32 tokens stay short)
    prompts = random_prompts([3, 17, 52, 64, 90])
    for prompt, out in zip(prompts, run(engine, prompts)):
        assert out == hf_greedy(hf_model, prompt)
    engine = make_engine(family[1])
    prompts = random_prompts([7, 31, 60])
    for prompt in prompts:
        engine.add_request(prompt, GREEDY_32)
    logits = engine.runner.forward(engine.scheduler.schedule())
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1]
        assert (logits[row].cpu() - ref).abs().max().item() < 1e-3


def test_batched_chunked_and_cached_equal_solo(family):
    path = family[1]
    prompts = random_prompts([100, 130], seed=3)
    prompts += [prompts[0][:64] + p for p in random_prompts([20, 30], seed=4)]
    plain = run(make_engine(path, enable_prefix_caching=False), prompts)
    assert [run(make_engine(path, enable_prefix_caching=False), [p])[0] for p in prompts] == plain
    assert run(make_engine(path, max_prefill_token_num=16), prompts) == plain
    cached = make_engine(path)
    run(cached, prompts[:1])
    assert run(cached, prompts) == plain
    assert cached.block_manager.num_hits > 0


def test_sharded_fused_checkpoint_loads(tmp_path):
    """Phi-3's fused qkv_proj/gate_up_proj and GLM-4's fused gate_up_proj, split over several files."""
    for kind in ('phi3', 'glm4'):
        whole = save_family(kind, str(tmp_path / kind))
        sharded = save_family(kind, str(tmp_path / f'{kind}_sharded'), max_shard_size='40KB')
        assert len(list((tmp_path / f'{kind}_sharded').glob('*.safetensors'))) > 2
        prompts = random_prompts([9, 33], seed=5)
        assert run(make_engine(sharded), prompts) == run(make_engine(whole), prompts)


def test_native_decoder_stack_only_for_plain_llama_layers(family, native_gemms):
    """bf16 on native GEMM weights: only families of plain Llama layers run in the native decoder stack
    (``tests/test_decoder_stack.py`` checks it step by step); the others fall back to their layers' forward
    (``native_weights()`` is None)."""
    kind, path = family
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=32, block_size=16), show_progress=False)
    model = engine.runner.model
    assert (model.native_stack is not None) == (kind in NATIVE_STACK)
    prompts = random_prompts([40, 9], seed=6)
    outs = run(engine, prompts)
    model.native_stack = None
    assert run(engine, prompts) == outs


def test_longrope_decode_crossing_keeps_what_is_cached(tmp_path):
    """A sequence whose decoding crosses the switch turns its new tokens by the long factors and keeps the
    keys cached before it: transformers' forward over its own cache, one token at a time."""
    path = save_family('phi3_longrope', str(tmp_path / 'phi3'))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = random_prompts([40], seed=9)[0]
    tokens = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(16):
            tokens.append(out.logits[0, -1].argmax().item())
            out = hf(torch.tensor([tokens[-1:]]), cache=out.past_key_values, use_cache=True,
                     position_ids=torch.tensor([[len(prompt) + len(tokens) - 1]]))
    assert run(make_engine(path), [prompt], GenerationConfig(max_new_tokens=16, ignore_eos=True)) == [tokens]


def test_sliding_window_narrower_than_the_context_is_refused(tmp_path):
    path = save_family('mistral', str(tmp_path / 'mistral'), sliding_window=64)
    with pytest.raises(ValueError, match='sliding-window attention is not supported'):
        make_engine(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = random_prompts([30], seed=7)[0]
    assert run(make_engine(path, session_len=64), [prompt]) == [hf_greedy(hf, prompt)]


@pytest.mark.parametrize('kind', ['phi3', 'glm4'])
def test_tp2_splits_fused_checkpoints(kind, tmp_path):
    """Each rank reads its own heads of a fused ``qkv_proj`` and its share of a fused ``gate_up_proj``."""
    path = save_family(kind, str(tmp_path / kind))
    prompts = random_prompts([5, 40], seed=8)
    expected = run(make_engine(path), prompts)
    engine = make_engine(path, tp=2)
    try:
        assert run(engine, prompts) == expected
    finally:
        engine.close()
