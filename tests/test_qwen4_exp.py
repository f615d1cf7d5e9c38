"""Qwen4-Exp (``Qwen4ExpForCausalLM``) against transformers on a tiny random model with every layer kind: Gated
DeltaNet layers with and without per-layer embeddings (PLE), QSA attention layers at contexts past the indexer's
budget, hyper-connections throughout. Greedy tokens and first-step logits in fp32 (prompts holding end-of-sequence
tokens, where the n-grams restart), the indexer's selection doing the work, batching, chunked prefill and preemption
equal to solo runs with every state slot given back, prefix caching and tensor parallelism refused; the hub's
``Qwen4ExpForConditionalGeneration`` layout read for its language model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_bf16_within_twice_transformers, assert_first_logits_close,
                           assert_matches_transformers, assert_prefix_caching_off_and_every_logit_matches,
                           assert_slots_free, hf_causal_lm, hf_last_logits)
from helpers import make_engine, random_prompts, run
from server_helpers import serve, tiny_engine

from lmdeploy.messages import GenerationConfig

EOS = 2  # the test tokenizer's <|im_end|>
# linear attention with PLE, QSA attention, linear attention without PLE, QSA attention; two streams; the indexer
# keeps 2 blocks of 4 tokens (and the last incomplete block), so contexts of 12 tokens or more attend sparsely
CONFIG = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              layer_types=['linear_attention', 'indexed_attention', 'linear_attention', 'indexed_attention'],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              output_gate_type='sigmoid', vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
              moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
              hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16, ngram_size=3, heads_per_ngram=2,
              ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
              indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
              rope_parameters=dict(rope_type='default', rope_theta=10000.0, partial_rotary_factor=0.5,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True),
              tie_word_embeddings=False, pad_token_id=None, eos_token_id=EOS, bos_token_id=0,
              architectures=['Qwen4ExpForCausalLM'])


@pytest.fixture(scope='module')
def qwen4_exp(tmp_path_factory) -> str:
    return save_random_model(Qwen4ExpTextConfig(**CONFIG), str(tmp_path_factory.mktemp('qwen4_exp')))


def with_eos(prompt: list[int], *places: int) -> list[int]:
    """``prompt`` with the end-of-sequence token at ``places``."""
    return [EOS if index in places else token for index, token in enumerate(prompt)]


def test_config_has_every_layer_kind():
    config = Qwen4ExpTextConfig(**CONFIG)
    assert config.layer_types.count('indexed_attention') == 2 and config.ple_layer_ids == [1]
    assert config.number_of_conv_states == 3  # transformers keeps PLE's two states beside the delta rule's


@pytest.mark.slow
def test_greedy_and_first_logits_match_transformers(qwen4_exp):
    """Prompts past the indexer's budget, two with end-of-sequence tokens (one right before the prompt's end)."""
    greedy = random_prompts([3, 17, 70], seed=0) + [with_eos(random_prompts([40], seed=1)[0], 12, 13, 30)]
    logits = random_prompts([5, 90], seed=2) + [with_eos(random_prompts([33], seed=3)[0], 31)]
    assert_matches_transformers(qwen4_exp, hf_causal_lm(qwen4_exp), greedy, logits)


def test_the_indexer_selects(qwen4_exp):
    """With a budget that keeps every block the logits of a 60-token prompt are off transformers' (which the test
    above matches): the selection does the work."""
    prompt = random_prompts([60], seed=4)
    reference = [hf_last_logits(hf_causal_lm(qwen4_exp), prompt[0])]
    assert_first_logits_close(make_engine(qwen4_exp), prompt, reference)
    dense = make_engine(qwen4_exp)
    for layer in dense.runner.model.layers:
        if not layer.is_linear:
            layer.self_attn.indexer.block_top_k = 1000
    with pytest.raises(AssertionError):
        assert_first_logits_close(dense, prompt, reference)


def test_batched_chunked_and_preempted_equal_solo(qwen4_exp):
    """The delta rule's, the n-grams' and PLE's convolution states carry over between prefill chunks of 7 tokens
    (shorter than the convolution's window), the indexer reads the keys of earlier chunks (blocks of 4), and a
    preempted sequence recomputes from zero; every state slot and KV block comes back."""
    prompts = random_prompts([60, 90], seed=3) + [with_eos(random_prompts([45], seed=5)[0], 10, 11)]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    plain = run(make_engine(qwen4_exp), prompts, config)
    assert [run(make_engine(qwen4_exp), [p], config)[0] for p in prompts] == plain
    engine = make_engine(qwen4_exp, max_prefill_token_num=7, block_size=4, max_batch_size=4)
    assert run(engine, prompts, config) == plain
    assert_slots_free(engine)
    tight = make_engine(qwen4_exp, num_gpu_blocks=14)
    assert run(tight, prompts, config) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_prefix_caching_off_and_every_position_matches(qwen4_exp, caplog):
    """Prefix caching, asked for, is off and says why; every position's logits equal transformers' (computed in
    chunks of 16, the states carried over)."""
    assert_prefix_caching_off_and_every_logit_matches(qwen4_exp, caplog, with_eos(random_prompts([50], seed=7)[0], 20))


def test_tensor_parallelism_is_refused(qwen4_exp):
    with pytest.raises(ValueError, match='linear-attention layers are not sharded'):
        make_engine(qwen4_exp, tp=2)


@pytest.fixture(scope='module')
def qwen4_exp_multimodal(qwen4_exp, tmp_path_factory) -> str:
    """The tiny model laid out as the hub's ``Qwen4ExpForConditionalGeneration``: its language model under
    ``model.language_model.``, beside a vision tower tensor."""
    path = tmp_path_factory.mktemp('qwen4_exp_multimodal')
    for name in Path(qwen4_exp).iterdir():
        if name.name not in ('config.json', 'model.safetensors'):
            shutil.copy(name, path)
    tensors = {name.replace('model.', 'model.language_model.', 1): tensor
               for name, tensor in load_file(f'{qwen4_exp}/model.safetensors').items()}
    tensors['model.visual.patch_embed.proj.weight'] = torch.randn(16, 3, 2, 4, 4)
    save_file(tensors, f'{path}/model.safetensors', metadata={'format': 'pt'})
    text_config = json.loads(Path(qwen4_exp, 'config.json').read_text())
    config = Qwen4ExpConfig(text_config=text_config, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                                                        num_heads=2, out_hidden_size=32, patch_size=4))
    config.architectures = ['Qwen4ExpForConditionalGeneration']
    config.save_pretrained(path)
    return str(path)


def test_conditional_generation_checkpoint_serves_its_language_model(qwen4_exp, qwen4_exp_multimodal):
    prompts = random_prompts([9, 40], seed=6)
    assert run(make_engine(qwen4_exp_multimodal), prompts) == run(make_engine(qwen4_exp), prompts)


def test_conditional_generation_checkpoint_refuses_images(qwen4_exp_multimodal):
    for server in serve(tiny_engine(qwen4_exp_multimodal), model_name='tiny'):
        content = [{'type': 'text', 'text': 'what is it?'}, {'type': 'image_url', 'image_url': {'url': 'x.png'}}]
        body = {'model': 'tiny', 'max_tokens': 4, 'messages': [{'role': 'user', 'content': content}]}
        response = httpx.post(f'{server.url}/v1/chat/completions', json=body)
        assert response.status_code == 400 and 'does not accept images' in response.json()['error']['message']


def test_int8_kv_cache_keeps_the_indexer_keys_in_the_model_dtype(qwen4_exp):
    """With ``quant_policy`` 8 a QSA layer's cache is K and V codes, their scales, then the indexer's raw keys in
    fp32 (tested to run, not for accuracy)."""
    engine = make_engine(qwen4_exp, quant_policy=8)
    cache = engine.runner.kv_caches[1]
    assert [t.dtype for t in cache] == [torch.uint8] * 2 + [torch.float32] * 3 and cache[-1].shape[-1] == 16
    assert all(len(out) == 32 for out in run(engine, random_prompts([30, 7], seed=8)))
    assert_slots_free(engine)


@pytest.mark.slow
def test_bf16_close_to_transformers(qwen4_exp):
    """bf16 on the CPU (packed projections): the last logits differ from transformers' in fp32 by at most twice
    what transformers' own bf16 model does."""
    assert_bf16_within_twice_transformers(qwen4_exp)
