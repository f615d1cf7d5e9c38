"""The CUDA path's Triton kernels inside the engine, on the CPU: within ``kernels.triton_on_cpu()`` an fp32 engine
runs them in Triton's interpreter. Its greedy tokens equal transformers' for what each family asks of the kernels
(paged prefill and decode attention, the KV fill, an int8 KV cache, sliding windows past the window, soft-capping,
sinks, MLA's latent cache, fused MoE), and the Triton kernels are what ran."""
from __future__ import annotations

import collections
import os

import pytest
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_deepseek import save_deepseek
from test_gpt_oss import save_gpt_oss
from test_model_families import save_family

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch import kernels

pytest.importorskip('triton')
# on a CUDA machine the Triton kernels run natively on CUDA tensors (LMDEPLOY_TEST_DEVICE=cuda) instead
pytestmark = pytest.mark.skipif(os.environ.get('TRITON_INTERPRET') != '1', reason="needs Triton's interpreter")

SAVERS = {
    'mistral_sliding': lambda path: save_family('mistral_sliding', path),
    'gemma2': lambda path: save_family('gemma2', path),
    'gpt_oss': save_gpt_oss,
    'deepseek_v3': save_deepseek,
}
# the Triton kernels each family must reach, beside the paged attention and the KV fill every family uses
EXPECTED = {'gpt_oss': {'fused_moe'},
            'deepseek_v3': {'fill_latent_cache', 'mla_prefill_attention', 'mla_decode_attention', 'fused_moe'}}
ATTENTION = {'prefill_attention', 'decode_attention', 'fill_kv_cache'}
TOKENS = GenerationConfig(max_new_tokens=6, do_sample=False, ignore_eos=True)


@pytest.fixture
def triton_calls(monkeypatch) -> collections.Counter:
    """Counts each Triton kernel's calls while the dispatched kernels take the Triton path on the CPU."""
    import lmdeploy.pytorch.kernels.cuda as cuda
    calls = collections.Counter()
    for name in cuda.__all__:
        kernel = getattr(cuda, name)
        monkeypatch.setattr(cuda, name, lambda *args, _name=name, _kernel=kernel, **kwargs:
                            calls.update([_name]) or _kernel(*args, **kwargs))
    with kernels.triton_on_cpu():
        yield calls


@pytest.mark.parametrize('kind', sorted(SAVERS))
def test_greedy_tokens_match_transformers(kind, tmp_path, triton_calls):
    path = SAVERS[kind](str(tmp_path))
    hf_model = hf_causal_lm(path)
    # 40 tokens: past the sliding families' 16-token window before decoding starts
    prompts = random_prompts([40, 5], seed=7)
    assert_transformers_greedy(hf_model, prompts, run(make_engine(path), prompts, TOKENS), TOKENS.max_new_tokens)
    expected = EXPECTED.get(kind, set()) | (set() if kind == 'deepseek_v3' else ATTENTION)
    assert expected <= set(triton_calls), triton_calls


def test_llama_plain_and_int8_kv_cache_match_transformers(tiny_llama, triton_calls):
    """Llama through the Triton kernels, then with ``quant_policy=8`` (the Triton KV fill quantizing, the attention
    kernels reading int8): both give transformers' greedy tokens on the tiny model."""
    prompts, hf_model = random_prompts([30, 7], seed=8), hf_causal_lm(tiny_llama)
    assert_transformers_greedy(hf_model, prompts, run(make_engine(tiny_llama), prompts, TOKENS), TOKENS.max_new_tokens)
    assert ATTENTION <= set(triton_calls), triton_calls
    calls_before = sum(triton_calls.values())
    int8 = run(make_engine(tiny_llama, quant_policy=8), prompts, TOKENS)
    assert_transformers_greedy(hf_model, prompts, int8, TOKENS.max_new_tokens)
    assert sum(triton_calls.values()) > calls_before


def test_outside_the_context_cpu_tensors_take_the_cpu_kernels(tiny_llama, monkeypatch):
    """Without ``triton_on_cpu`` no Triton kernel runs on CPU tensors (left here, should the whole session run in it:
    ``LMDEPLOY_TEST_KERNELS=triton``)."""
    import lmdeploy.pytorch.kernels as kernels
    import lmdeploy.pytorch.kernels.cuda as cuda

    monkeypatch.setattr(kernels, '_triton_on_cpu', False)

    def refuse(*args, **kwargs):
        raise AssertionError('a Triton kernel ran on CPU tensors')

    for name in cuda.__all__:
        monkeypatch.setattr(cuda, name, refuse)
    assert len(run(make_engine(tiny_llama), random_prompts([9], seed=9), TOKENS)[0]) == TOKENS.max_new_tokens
