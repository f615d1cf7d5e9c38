"""Arcee (AFM-4.5B) from GGUF: a tiny random transformers model written as llama.cpp's converter writes it (LlamaModel's
keys and q/k row order, its YaRN keys, no gate tensors), read back into the original tensors and served token for token
like transformers on the original model; Q8_0 projections served as their blocks, in bf16 in the native decoder
stack."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import save_random_model
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_arcee import arcee_config
from test_gguf import _add_tokenizer, finish, llama_permute
from test_gguf_llama_like import converted_model, converter_arrays

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine


YARN = {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0, 'original_max_position_embeddings': 32}


def save_gguf(path: Path, quantize: bool) -> tuple[Path, str, int]:
    """A tiny random Arcee with YaRN saved in ``path / 'hf'`` and written to ``path / 'model.gguf'``: the file, the
    folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.ARCEE])
    vocab = _add_tokenizer(writer)
    folder = save_random_model(arcee_config(vocab_size=vocab, rope_parameters=YARN), str(path / 'hf'))
    config = AutoConfig.from_pretrained(folder)
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, YARN['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_vocab_size, vocab), (writer.add_rope_dimension_count, config.head_dim),
                       (writer.add_rope_scaling_type, gguf.RopeScalingType.YARN),
                       (writer.add_rope_scaling_factor, YARN['factor']),
                       (writer.add_rope_scaling_orig_ctx_len, YARN['original_max_position_embeddings'])]:
        add(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.ARCEE, config.num_hidden_layers)
    for name, data in converter_arrays(folder, config, quantize).items():
        if name.endswith(('q_proj.weight', 'k_proj.weight')):  # row by row: Q8_0 blocks permute whole
            data = llama_permute(data, config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data),
                          raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    finish(writer)
    return src, folder, vocab


def test_gguf_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(tmp_path, quantize=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    converted = converted_model(src, tmp_path, hf)
    assert converted.config.rope_parameters.items() >= hf.config.rope_parameters.items()

    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


def test_gguf_q8_0_kept_as_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's and the down projections in Q8_0 are served as their blocks; the ungated up projection is
    dequantized (the GGUF block tables know gated MLPs only); token for token like transformers on the weights the
    blocks hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    assert_q8_0_attention_and_down_served_as_blocks(*save_gguf(tmp_path, quantize=True))


def assert_q8_0_attention_and_down_served_as_blocks(src: Path, folder: str, vocab: int) -> None:
    """The Q8_0 file ``src`` of the ungated-MLP model saved in ``folder``: attention's and the down projections
    are served as their blocks, nothing else of the MLP is; token for token like transformers on the weights the
    blocks hold."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    for layer in range(hf.config.num_hidden_layers):
        for name in ('self_attn.qkv_proj', 'self_attn.o_proj', 'mlp.down_proj'):
            assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
        assert not any(name.startswith(f'layers.{layer}.mlp.') and 'down' not in name for name in layer_types)
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


def test_gguf_q8_0_bf16_native_stack_gives_the_layers_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             native_gemms) -> None:
    """bf16 on the native GEMMs: the Q8_0 layers (and the dequantized up projection, ``ungated_mlp`` ``relu2``) run
    in the native decoder stack, its small steps on the Q8_0 GEMV, with the tokens of the layers' own forward."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, _, vocab = save_gguf(tmp_path, quantize=True)
    engine = Engine(str(src), PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None and model.native_stack.small is not None
    prompts = random_prompts([40, 9, 23], seed=6, vocab=vocab)
    outs = run(engine, prompts)
    model.native_stack = None
    assert run(engine, prompts) == outs
