"""Kimi-Linear from GGUF: a file written as llama.cpp's converter (``KimiLinearModel``) writes ``kimi-linear`` from
the checkpoint's tensors (the q/k/v convolutions as ``[1, C, 1, K]``, ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as
``ssm_dt.bias``, MLA's ``kv_b`` split into ``k_b``/``v_b``, the experts stacked; a KV head count a layer, 0 for KDA)
reads back into the checkpoint and serves tokens and first-step logits like transformers; a file whose experts are
Q8_0 serves them as their blocks; a file whose ``attention.head_count_kv`` is one number is refused saying why."""
from __future__ import annotations

from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, KimiLinearConfig

from conftest import save_random_model
from family_checks import assert_matches_transformers, hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf import _add_tokenizer, finish
from test_kimi_linear import CONFIG

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.weights.file_checks import open_gguf
from lmdeploy.pytorch.weights.gguf import convert_gguf, gguf_config

EXPERT_PARTS = (('w1', gguf.MODEL_TENSOR.FFN_GATE_EXP), ('w2', gguf.MODEL_TENSOR.FFN_DOWN_EXP),
                ('w3', gguf.MODEL_TENSOR.FFN_UP_EXP))


@pytest.fixture(scope='module')
def kimi_path(tmp_path_factory) -> str:
    """The tiny Kimi-Linear of ``test_kimi_linear.py`` over the GGUF test tokenizer's vocabulary."""
    folder = tmp_path_factory.mktemp('kimi_linear_gguf')
    config = KimiLinearConfig(**CONFIG)
    config.vocab_size = _add_tokenizer(gguf.GGUFWriter(str(folder / 'probe.gguf'), 'kimi-linear'))
    return save_random_model(config, str(folder / 'hf'), std={'e_score_correction_bias': 0.1})


def converter_tensors(path: str, layers: int, experts: int) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under their GGUF names, as ``KimiLinearModel.modify_tensors`` writes them (the
    checkpoint's dense MLP is ``mlp.*``: transformers 5 saves it under ``block_sparse_moe``)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.KIMI_LINEAR, layers)
    out = {}
    for name, tensor in load_file(f'{path}/model.safetensors').items():
        data = tensor.numpy()
        if '.experts.' in name:
            continue
        name = name.replace('e_score_correction_bias', 'e_score_correction.bias').replace('.dt_bias', '.dt_proj.bias')
        if name.endswith(('block_sparse_moe.gate_proj.weight', 'block_sparse_moe.up_proj.weight',
                          'block_sparse_moe.down_proj.weight')):
            name = name.replace('.block_sparse_moe.', '.mlp.')
        if name.endswith('conv1d.weight'):
            data = data.reshape(1, data.shape[0], 1, data.shape[-1])
        elif name.endswith('A_log'):
            data = -np.exp(data)
        if name.endswith('kv_b_proj.weight'):
            nope, heads = CONFIG['qk_nope_head_dim'], CONFIG['num_attention_heads']
            kv_b = data.reshape(heads, nope + CONFIG['v_head_dim'], -1)
            out[names.get_name(name.replace('kv_b', 'k_b'), try_suffixes=('.weight',))] = kv_b[:, :nope].transpose(
                0, 2, 1)
            out[names.get_name(name.replace('kv_b', 'v_b'), try_suffixes=('.weight',))] = kv_b[:, nope:]
            continue
        out[names.get_name(name, try_suffixes=('.weight', '.bias'))] = data
    checkpoint = load_file(f'{path}/model.safetensors')
    for layer in range(layers):
        prefix = f'model.layers.{layer}.block_sparse_moe.experts'
        for part, tensor_kind in EXPERT_PARTS:
            stacked = [checkpoint.get(f'{prefix}.{e}.{part}.weight') for e in range(experts)]
            if stacked[0] is not None:
                out[gguf.TENSOR_NAMES[tensor_kind].format(bid=layer) + '.weight'] = torch.stack(stacked).numpy()
    return out


def write_kimi_gguf(path: str, dest: Path, kv_heads: list[int] | int | None = None, q8_experts: bool = False) -> None:
    """The checkpoint at ``path`` as a ``kimi-linear`` F32 file (``kv_heads``: another ``attention.head_count_kv``;
    ``q8_experts``: the stacked experts in Q8_0)."""
    config = AutoModelForCausalLM.from_config(KimiLinearConfig.from_pretrained(path)).config
    layers = config.num_hidden_layers
    writer = gguf.GGUFWriter(str(dest), 'kimi-linear')
    _add_tokenizer(writer)
    if kv_heads is None:
        kv_heads = [1 if kind == 'full_attention' else 0 for kind in config.layer_types]
    for add, value in [(writer.add_block_count, layers), (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps), (writer.add_vocab_size, config.vocab_size),
                       (writer.add_expert_count, config.num_local_experts),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_ssm_conv_kernel, config.linear_conv_kernel_dim),
                       (writer.add_kda_head_dim, config.linear_head_dim),
                       (writer.add_kv_lora_rank, config.kv_lora_rank),
                       (writer.add_rope_dimension_count, config.qk_rope_head_dim),
                       (writer.add_key_length, config.kv_lora_rank + config.qk_rope_head_dim),
                       (writer.add_key_length_mla, config.qk_nope_head_dim + config.qk_rope_head_dim),
                       (writer.add_value_length_mla, config.v_head_dim),
                       (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
                       (writer.add_expert_shared_count, config.num_shared_experts),
                       (writer.add_leading_dense_block_count, config.mlp_layer_types.count('dense')),
                       (writer.add_expert_weights_scale, config.routed_scaling_factor)]:
        add(value)
    for name, data in converter_tensors(path, layers, config.num_local_experts).items():
        data = np.ascontiguousarray(data)
        q8 = q8_experts and name.endswith('_exps.weight')
        writer.add_tensor(name, quantize(data, Q.Q8_0) if q8 else data, raw_dtype=Q.Q8_0 if q8 else None)
    finish(writer)


def test_f32_file_reads_back_the_checkpoint_and_serves_like_transformers(kimi_path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'kimi.gguf'
    write_kimi_gguf(kimi_path, src)
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    hf = hf_causal_lm(kimi_path)
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    for field in ('architectures', 'model_type', 'layer_types', 'mlp_layer_types', 'linear_head_dim',
                  'linear_num_heads', 'linear_conv_kernel_dim', 'q_lora_rank', 'kv_lora_rank', 'qk_rope_head_dim',
                  'qk_nope_head_dim', 'v_head_dim', 'num_local_experts', 'num_experts_per_tok', 'n_shared_experts',
                  'norm_topk_prob', 'n_group', 'topk_group', 'tie_word_embeddings'):
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    for field in ('routed_scaling_factor', 'rms_norm_eps'):  # float32 in the file
        assert getattr(converted.config, field) == pytest.approx(getattr(hf.config, field), rel=1e-7), field
    expected, state = hf.state_dict(), converted.state_dict()
    assert state.keys() == expected.keys()
    for name in expected:  # A_log went through exp and log
        assert torch.allclose(state[name], expected[name], rtol=1e-6, atol=1e-7) if name.endswith('A_log') else \
            torch.equal(state[name], expected[name]), name
    vocab = hf.config.vocab_size
    assert_matches_transformers(str(src), hf, random_prompts([5, 17, 70], vocab=vocab),
                                random_prompts([7, 31], vocab=vocab))


def test_q8_0_experts_kept_as_blocks(kimi_path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The routed experts in Q8_0 are served as their blocks (the rest dequantized, as ``deepseek2``'s); greedy
    tokens like transformers on the weights the file holds."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'kimi_q8.gguf'
    write_kimi_gguf(kimi_path, src, q8_experts=True)
    config = gguf_config(open_gguf(str(src)), str(src))
    assert config['quantization_config']['ggml_types'] == {
        f'layers.{layer}.mlp.experts.{name}': 'Q8_0' for layer in (1, 2, 3) for name in ('gate_up_proj', 'down_proj')}
    hf = hf_causal_lm(kimi_path)
    with torch.no_grad():  # the weights as the Q8_0 blocks hold them
        for name, param in hf.named_parameters():
            if name.endswith(('experts.gate_up_proj', 'experts.down_proj')):
                param.copy_(torch.from_numpy(dequantize(quantize(param.numpy(), Q.Q8_0), Q.Q8_0)))
    prompts = random_prompts([5, 30], vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


def test_one_kv_head_count_for_every_layer_is_refused(kimi_path, tmp_path: Path) -> None:
    """Without a KV head count a layer the file cannot tell KDA layers from latent-attention ones."""
    src = tmp_path / 'flat.gguf'
    write_kimi_gguf(kimi_path, src, kv_heads=1)
    with pytest.raises(ConfigError, match='head_count_kv should hold a value for each of the 4 layers'):
        gguf_config(open_gguf(str(src)), str(src))
