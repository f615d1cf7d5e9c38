"""Phi-3, GLM, GLM-4, SmolLM3, Mistral, Ministral 3, Gemma 2, Gemma 3, OLMo 2, OLMo 3, Granite, Seed-OSS, ERNIE 4.5
and ERNIE 4.5 MoE against transformers on tiny random models saved by transformers: greedy tokens and first-step
logits in fp32, batching, chunked prefill and prefix-cache hits. Sliding windows (16 tokens) are narrower than
most prompts."""
from __future__ import annotations

import pytest
from transformers import (Ernie4_5_MoeConfig, Ernie4_5Config, Gemma2Config, Gemma3TextConfig, Glm4Config, GlmConfig,
                          GraniteConfig, Ministral3Config, MistralConfig, Olmo2Config, Olmo3Config, Phi3Config,
                          Qwen2Config, SeedOssConfig, SmolLM3Config)

from conftest import MINISTRAL3_ROPE, VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_matches_transformers,
                           assert_tp2_equals_tp1, hf_causal_lm, prefix_sharing_prompts)
from helpers import assert_transformers_greedy, hf_greedy, make_engine, random_prompts, run

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.models.llama import layer_window

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
    'mistral_sliding': lambda: MistralConfig(**SHAPE, head_dim=16, sliding_window=16),
    'ministral3': lambda: Ministral3Config(**SHAPE, head_dim=16, rope_parameters=MINISTRAL3_ROPE),
    # local and global layers; scores and logits soft-capped where random weights reach the cap
    'gemma2': lambda: Gemma2Config(**{**SHAPE, 'num_hidden_layers': 3}, head_dim=16, sliding_window=16,
                                   query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                                   final_logit_softcapping=6.0),
    # local layers turn by their own rope base; tied embeddings
    'gemma3': lambda: Gemma3TextConfig(**{**SHAPE, 'num_hidden_layers': 3, 'tie_word_embeddings': True}, head_dim=16,
                                       sliding_window=16, query_pre_attn_scalar=24,
                                       layer_types=['sliding_attention', 'full_attention', 'sliding_attention'],
                                       rope_parameters={'sliding_attention': {'rope_type': 'default',
                                                                              'rope_theta': 100.0},
                                                        'full_attention': {'rope_type': 'default',
                                                                           'rope_theta': 10000.0}}),
    # post-norms, q/k norms over all heads
    'olmo2': lambda: Olmo2Config(**SHAPE),
    # three sliding-window layers, then a full one turning by YaRN (OLMo 3's rope on its global layers)
    'olmo3': lambda: Olmo3Config(**{**SHAPE, 'num_hidden_layers': 4}, sliding_window=16,
                                 rope_parameters={'full_attention': {'rope_type': 'yarn', 'rope_theta': 10000.0,
                                                                     'factor': 4.0,
                                                                     'original_max_position_embeddings': 256},
                                                  'sliding_attention': {'rope_type': 'default',
                                                                        'rope_theta': 10000.0}}),
    'granite': lambda: GraniteConfig(**SHAPE, embedding_multiplier=3.0, attention_multiplier=0.1,
                                     residual_multiplier=0.5, logits_scaling=2.0),
    # q/k/v biases, none on o_proj
    'seed_oss': lambda: SeedOssConfig(**SHAPE, head_dim=16, attention_bias=True, attention_out_bias=False),
    # rotary over neighbouring pairs; biases on every projection
    'ernie4_5': lambda: Ernie4_5Config(**SHAPE, head_dim=16, use_bias=True),
    # a dense first layer, then experts chosen by softmax score plus a correction bias, and a shared expert
    'ernie4_5_moe': lambda: Ernie4_5_MoeConfig(**{**SHAPE, 'num_hidden_layers': 3}, head_dim=16,
                                               moe_intermediate_size=32, moe_num_experts=4, moe_k=2,
                                               moe_num_shared_experts=1, moe_layer_start_index=1),
}
# families the native decoder stack runs on the CPU (Llama layers: full, partial or no rotary, sliding windows;
# GLM's and ERNIE 4.5's interleaved rotary and GLM-4's output norms; Ministral 3's query scale; Gemma 2 and 3;
# Seed-OSS; Granite's residual multiplier; OLMo 2/3's post-norms and q/k norms over all heads; ERNIE 4.5 MoE's
# biased softmax routing): all of them
NATIVE_STACK = {'phi3', 'phi3_longrope', 'smollm3', 'mistral', 'mistral_sliding', 'ministral3', 'glm', 'glm4', 'gemma2',
                'gemma3', 'olmo2', 'olmo3', 'seed_oss', 'ernie4_5', 'ernie4_5_moe', 'granite'}


def save_family(kind: str, path: str, max_shard_size: str = '50GB', **overrides) -> str:
    """A tiny random model of ``kind`` saved with transformers (sharded below ``max_shard_size``)."""
    config = FAMILIES[kind]()
    for name, value in overrides.items():
        setattr(config, name, value)
    return save_random_model(config, path, max_shard_size)


@pytest.fixture(scope='module', params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, save_family(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def hf_model(family):
    return hf_causal_lm(family[1])


def test_greedy_and_first_logits_match_transformers(family, hf_model):
    assert_matches_transformers(family[1], hf_model, random_prompts([3, 17, 52, 64, 90]), random_prompts([7, 31, 60]))


def test_batched_chunked_and_cached_equal_solo(family):
    assert_batched_chunked_and_cached_equal_solo(family[1], prefix_sharing_prompts())


def test_sharded_fused_checkpoint_loads(tmp_path):
    """Phi-3's fused qkv_proj/gate_up_proj and GLM-4's fused gate_up_proj, split over several files."""
    for kind in ('phi3', 'glm4'):
        whole = save_family(kind, str(tmp_path / kind))
        sharded = save_family(kind, str(tmp_path / f'{kind}_sharded'), max_shard_size='40KB')
        assert len(list((tmp_path / f'{kind}_sharded').glob('*.safetensors'))) > 2
        prompts = random_prompts([9, 33], seed=5)
        assert run(make_engine(sharded), prompts) == run(make_engine(whole), prompts)


def test_native_decoder_stack_families(family, native_gemms):
    """bf16 on native GEMM weights: the families of ``NATIVE_STACK`` run in the native decoder stack
    (``tests/test_decoder_stack.py`` checks it step by step), with the tokens of their layers' forward; the others
    would fall back to it (``native_weights()`` is None)."""
    kind, path = family
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=32, block_size=16), show_progress=False)
    model = engine.runner.model
    assert (model.native_stack is not None) == (kind in NATIVE_STACK)
    prompts = random_prompts([40, 9], seed=6)
    outs = run(engine, prompts)
    model.native_stack = None
    assert run(engine, prompts) == outs


@pytest.mark.parametrize('overlap', [False, True], ids=['plain', 'overlap'])
def test_longrope_decode_crossing_recomputes_like_transformers(tmp_path, overlap):
    """Sequences that grow past ``original_max_position_embeddings`` (48) while decoding, at different steps
    of one batch, are computed again with the long factors, as transformers' ``generate`` does; a long
    prompt does not reuse the blocks that a short one cached with the short factors."""
    path = save_family('phi3_longrope', str(tmp_path / 'phi3'))
    hf = hf_causal_lm(path)
    prompts = random_prompts([20, 40, 47, 48], seed=9)
    engine = make_engine(path, overlap_schedule=overlap)
    # generate's own steps (not one forward of prompt and tokens): the rotary factors change during the run
    assert run(engine, prompts) == [hf_greedy(hf, p) for p in prompts]
    assert engine.scheduler.num_preemptions == 0 and engine.block_manager.num_free_blocks == 128

    short = random_prompts([40], seed=10)[0]
    long = short[:32] + random_prompts([30], seed=11)[0]
    engine = make_engine(path, overlap_schedule=overlap)
    run(engine, [short], GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert run(engine, [long]) == [hf_greedy(hf, long)]
    assert engine.block_manager.num_hits == 0


def test_layer_window_reads_layer_types_or_the_config():
    qwen2 = Qwen2Config(num_hidden_layers=4, sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert [layer_window(qwen2, i) for i in range(4)] == [None, None, 8, 8]
    assert [layer_window(Qwen2Config(num_hidden_layers=2, sliding_window=8), i) for i in range(2)] == [None, None]
    assert [layer_window(MistralConfig(num_hidden_layers=2, sliding_window=8), i) for i in range(2)] == [8, 8]
    assert [layer_window(MistralConfig(num_hidden_layers=2, sliding_window=None), i) for i in range(2)] == [None] * 2
    assert [layer_window(Gemma2Config(num_hidden_layers=3, sliding_window=8), i) for i in range(3)] == [8, None, 8]


def test_phi3_sliding_window(tmp_path):
    """A Phi-3 config with a sliding window (Phi-3-mini's is 2047) attends over it in every layer."""
    path = save_family('phi3', str(tmp_path / 'phi3'), sliding_window=16)
    hf = hf_causal_lm(path)
    prompts = random_prompts([40, 70], seed=7)
    assert_transformers_greedy(hf, prompts, run(make_engine(path), prompts))


@pytest.mark.parametrize('kind', ['phi3', 'glm4'])
def test_tp2_splits_fused_checkpoints(kind, tmp_path):
    """Each rank reads its own heads of a fused ``qkv_proj`` and its share of a fused ``gate_up_proj``."""
    assert_tp2_equals_tp1(save_family(kind, str(tmp_path / kind)), random_prompts([5, 40], seed=8))


def test_olmo3_tp2_equals_tp1(tmp_path):
    """OLMo's q/k norms over all heads take every rank's sums of squares (``nn/norm.py``'s ``norm_across_heads``);
    OLMo 3's sliding layers turn by their own rope on each rank."""
    path = save_family('olmo3', str(tmp_path / 'olmo3'))
    assert_tp2_equals_tp1(path, random_prompts([5, 40], seed=8), logits=True)
