"""Shared fixtures: tiny random models saved with transformers, and the default model."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before anything imports triton.language (transformers' image processors do): the Triton kernel
    # tests run in the interpreter on the CPU.
    os.environ.setdefault('TRITON_INTERPRET', '1')
    from triton_interpreter import skip_nested_language_patches
    skip_nested_language_patches()
# Tensor-parallel workers fork from a server that imported torch and the engine once: a tp=2 engine then starts
# in about 0.5 s instead of 4-5 s. test_tp.py runs the default, 'spawn', too.
os.environ.setdefault('LMDEPLOY_TP_START_METHOD', 'forkserver')
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)



@pytest.fixture(scope='module')
def native():
    """The native CPU kernels (the test skips where they cannot be built)."""
    from lmdeploy.pytorch.kernels import cpu
    module = cpu.native()
    if module is None:
        pytest.skip('no C++ compiler for the native CPU kernels')
    return module


@pytest.fixture
def native_gemms(native, monkeypatch):
    """The native kernels, with the native bf16 GEMM running the CPU's bf16 linear layers, so that bf16 and
    W8A8 models run in the native decoder stack; on AMX CPUs the engine itself prefers oneDNN's bf16 GEMM.
    Skips where the CPU lacks the instructions: AVX512-BF16 (bf16 GEMM) or AVX512-VNNI (int8 GEMM)."""
    from lmdeploy.pytorch.kernels import cpu
    if not native.bf16_gemm_available() or not native.int8_gemm_available():
        pytest.skip('the native GEMMs need AVX512-BF16 and AVX512-VNNI')
    monkeypatch.setattr(cpu, 'bf16_gemm', lambda: native)
    return native


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ['Hello world! The quick brown fox jumps over the lazy dog.', 'héllo 世界 🙂 naïve café',
          'Paged attention stores keys and values in blocks.', '0123456789 + - * / = ( ) [ ] { }']
VOCAB_SIZE = 320
# Ministral 3's YaRN (an attention factor of mscale / mscale_all_dim's) and query scale, growing every 16 positions,
# for tiny models
MINISTRAL3_ROPE = {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 64.0, 'original_max_position_embeddings': 16,
                   'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 0.5,
                   'llama_4_scaling_beta': 0.5}

TINY_CONFIGS = {
    'llama': lambda: LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE,
                                 max_position_embeddings=1024, tie_word_embeddings=False,
                                 rope_parameters={'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0,
                                                  'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                                  'original_max_position_embeddings': 128}),
    'qwen2': lambda: Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE,
                                 max_position_embeddings=1024, tie_word_embeddings=True),
    'qwen3': lambda: Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                 vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=False),
    'mixtral': lambda: MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                                     num_local_experts=4, num_experts_per_tok=2),
    'qwen2_moe': lambda: Qwen2MoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE,
                                        max_position_embeddings=1024, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                        mlp_only_layers=[1], tie_word_embeddings=True),
    'qwen3_moe': lambda: Qwen3MoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        vocab_size=VOCAB_SIZE, max_position_embeddings=1024, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 8, special_tokens=['<|endoftext|>', '<|im_start|>',
                                                                             '<|im_end|>'],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|im_end|>', bos_token='<|endoftext|>',
                                   chat_template=CHAT_TEMPLATE)


def save_random_model(config, path: str, max_shard_size: str = '50GB', std: dict[str, float] | None = None) -> str:
    """A causal LM of ``config`` with random weights, saved with the tokenizer (sharded below ``max_shard_size``).

    Parameters draw from N(0, 0.2); ``std`` maps name suffixes to other deviations, for parameters and for
    buffers (buffers it does not name keep their values)."""
    std = std or {}
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, next((v for k, v in std.items() if name.endswith(k)), 0.2))
        for name, buffer in model.named_buffers():
            for suffix, value in std.items():
                if name.endswith(suffix):
                    buffer.normal_(0, value)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_model(kind: str, path: str, **overrides) -> str:
    """A tiny random model of ``kind`` (its config changed by ``overrides``) saved with its tokenizer."""
    config = TINY_CONFIGS[kind]()
    for name, value in overrides.items():
        setattr(config, name, value)
    return save_random_model(config, path)


@pytest.fixture(scope='session', params=sorted(TINY_CONFIGS))
def tiny_model(request, tmp_path_factory) -> str:
    """Path of a tiny random model of each supported family."""
    return save_tiny_model(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='session')
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model('llama', str(tmp_path_factory.mktemp('llama')))


@pytest.fixture(scope='session')
def default_model_gguf() -> str:
    from lmdeploy.model_source import default_model_path
    return default_model_path()


@pytest.fixture(scope='session')
def default_model_reference(default_model_gguf):
    """transformers' own reading of the default model's GGUF file, in fp32: it takes a while, so the tests
    that compare against it share one."""
    from helpers import load_gguf_reference
    return load_gguf_reference(default_model_gguf)


@pytest.fixture(autouse=True, scope='session')
def _kernels():
    """``LMDEPLOY_TEST_KERNELS=triton``: engines on the CPU run the CUDA path's Triton kernels in the interpreter."""
    if os.environ.get('LMDEPLOY_TEST_KERNELS') != 'triton':
        yield
        return
    from lmdeploy.pytorch.kernels import triton_on_cpu
    with triton_on_cpu():
        yield


@pytest.fixture(autouse=True, scope='session')
def _threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope='session')
def _one_ssl_context():
    """httpx makes an SSL context (about 20 ms of CPU) for each client, and each ``httpx.get``/``post`` is a client:
    the tests make thousands, all for plain-HTTP servers. The default context is made once instead."""
    from httpx._transports import default
    make = default.create_ssl_context
    shared = functools.cache(make)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return shared()
        return make(verify=verify, cert=cert, trust_env=trust_env)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(default, 'create_ssl_context', create_ssl_context)
        yield


@pytest.fixture(scope='session')
def api_server(tiny_llama):
    """A uvicorn server (background thread) for the tiny Llama, model name 'tiny'; yields its ServerThread."""
    from server_helpers import serve, tiny_engine

    yield from serve(tiny_engine(tiny_llama), model_name='tiny')


@pytest.fixture
def tmp_gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A test's own cache folder (``LMDEPLOY_CACHE_DIR``): GGUF files convert afresh into it."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    return tmp_path / 'cache'
