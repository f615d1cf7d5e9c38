"""Hunyuan-A13B and the dense Hunyuan from GGUF (llama.cpp's ``hunyuan-moe``, ``hunyuan-dense``): a tiny random
transformers model written as convert_hf_to_gguf.py's HunYuanMoEModel and HunYuanModel write it (q/k rows as they
are, the q/k norms after the rotary as ``attn_{q,k}_norm``, the router ``gate.wg`` as ``ffn_gate_inp``, the shared MLP
as ``ffn_*_shexp``, the experts stacked per projection, NTK-alpha's stretched base as ``rope.freq_base`` with no
scaling and a 256K context), read back into the original tensors and served token for token like transformers on the
original model (NTK-alpha rope); Q8_0 projections, experts and shared MLP served as their blocks."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import save_random_model
from family_checks import assert_first_logits_close, hf_last_logits
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf import _add_tokenizer, finish
from test_gguf_llama_like import converted_model, converter_arrays
from test_hunyuan import NTK_ALPHA, hunyuan_config
from test_hunyuan_dense import hunyuan_dense_config

ARCHS = {'hunyuan_v1_moe': gguf.MODEL_ARCH.HUNYUAN_MOE, 'hunyuan_v1_dense': gguf.MODEL_ARCH.HUNYUAN_DENSE}
CONTEXT = 256 * 1024  # the converter's for an NTK-alpha rope


def stretched_base(config) -> float:
    """The converter's ``rope.freq_base``: NTK-alpha's base, ``rope_theta * alpha ** (d / (d - 2))``."""
    dim = config.head_dim
    return NTK_ALPHA['rope_theta'] * NTK_ALPHA['alpha']**(dim / (dim - 2))


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """What the converter writes for ``config`` (a TextModel's keys, then Hunyuan's)."""
    for add, value in [(writer.add_block_count, config.num_hidden_layers), (writer.add_context_length, CONTEXT),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_rope_freq_base, stretched_base(config)),
                       (writer.add_rope_scaling_type, gguf.RopeScalingType.NONE),
                       (writer.add_rope_scaling_factor, 1), (writer.add_rope_scaling_orig_ctx_len, CONTEXT)]:
        add(value)
    if config.model_type == 'hunyuan_v1_moe':
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.moe_topk)
        writer.add_expert_shared_feed_forward_length(config.intermediate_size)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_expert_shared_count(1)


def save_gguf(kind: str, path: Path, quantize: bool) -> tuple[Path, str, int]:
    """A tiny random ``kind`` (``hunyuan_v1_moe`` or ``hunyuan_v1_dense``) saved in ``path / 'hf'`` and written to
    ``path / 'model.gguf'``: the file, the folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[ARCHS[kind]])
    vocab = _add_tokenizer(writer)
    make_config = hunyuan_config if kind == 'hunyuan_v1_moe' else hunyuan_dense_config
    folder = save_random_model(make_config(vocab_size=vocab), str(path / 'hf'))
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    names = gguf.get_tensor_name_map(ARCHS[kind], config.num_hidden_layers)
    for name, data in converter_arrays(folder, config, quantize).items():
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data),
                          raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    finish(writer)
    return src, folder, vocab


@pytest.mark.parametrize('kind', sorted(ARCHS))
def test_gguf_matches_transformers(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file's plain rotary of the stretched base is transformers' NTK-alpha rope: 32 greedy tokens of three
    prompts and the first-step logits within 1e-3 of transformers on the original model."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path, quantize=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    converted = converted_model(src, tmp_path, hf)
    assert converted.config.rope_parameters['rope_type'] == 'default'
    assert converted.config.rope_parameters['rope_theta'] == pytest.approx(stretched_base(hf.config), rel=1e-7)
    assert converted.config.tie_word_embeddings == hf.config.tie_word_embeddings

    prompts = random_prompts([5, 23, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))
    assert_first_logits_close(make_engine(str(src)), prompts, [hf_last_logits(hf, p) for p in prompts])


@pytest.mark.parametrize('kind', sorted(ARCHS))
def test_gguf_q8_0_kept_as_blocks(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection in Q8_0 (the experts and the shared MLP too; the fp32 router stays F32, as llama.cpp keeps
    it) is served as its blocks, token for token like transformers on the weights those blocks hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path, quantize=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    mlps = (('mlp.experts.gate_up_proj', 'mlp.experts.down_proj', 'mlp.shared_mlp.gate_up_proj',
             'mlp.shared_mlp.down_proj') if kind == 'hunyuan_v1_moe' else ('mlp.gate_up_proj', 'mlp.down_proj'))
    for layer in range(hf.config.num_hidden_layers):
        for name in ('self_attn.qkv_proj', 'self_attn.o_proj', *mlps):
            assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
