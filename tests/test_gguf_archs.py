"""Gemma 2, Gemma 3, gpt-oss and DeepSeek-V2/V3 from GGUF: a tiny random transformers model written as llama.cpp's
convert_hf_to_gguf.py writes it (gguf-py's tensor names and metadata keys; Gemma's norms stored as ``1 + weight``;
gpt-oss's experts split into gate and up, transposed, in MXFP4; DeepSeek's experts per projection, its ``kv_b``
split into ``k_b`` and ``v_b`` or whole as older converters wrote it), served by the engine token for token like
transformers on the original model (with gpt-oss's experts as the file's MXFP4 gives them)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GptOssConfig

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_deepseek import ds_config
from test_gguf import _add_tokenizer, finish
from test_gpt_oss import CONFIG as GPT_OSS

from lmdeploy.pytorch.weights.gguf import convert_gguf

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=1024, sliding_window=16, pad_token_id=None)
PROJECTIONS = tuple(f'{name}_proj.weight' for name in ('q', 'k', 'v', 'o', 'gate', 'up', 'down'))
ARCHS = {'gemma2': gguf.MODEL_ARCH.GEMMA2, 'gemma3': gguf.MODEL_ARCH.GEMMA3, 'gpt_oss': gguf.MODEL_ARCH.GPT_OSS,
         'deepseek_v3': gguf.MODEL_ARCH.DEEPSEEK2, 'deepseek_v2': gguf.MODEL_ARCH.DEEPSEEK2}


def hf_config(kind: str, vocab: int):
    """Configs that llama.cpp can represent: queries scaled by 1/sqrt(head_dim) (Gemma), its sliding-window
    layer steps (Gemma 2: every other layer, Gemma 3: five of six), Gemma 3's local rope base of 10000."""
    if kind == 'gemma2':  # soft-caps that random weights reach
        return Gemma2Config(**SHAPE, num_hidden_layers=3, vocab_size=vocab, query_pre_attn_scalar=16,
                            attn_logit_softcapping=4.0, final_logit_softcapping=6.0)
    if kind == 'gemma3':  # linear scaling on the global layers, as Gemma 3 4B and up
        rope = {'full_attention': {'rope_type': 'linear', 'rope_theta': 1e6, 'factor': 8.0},
                'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0}}
        return Gemma3TextConfig(**SHAPE, num_hidden_layers=7, vocab_size=vocab, query_pre_attn_scalar=16,
                                rope_parameters=rope, final_logit_softcapping=6.0)
    if kind == 'gpt_oss':
        return GptOssConfig(**{**GPT_OSS, 'vocab_size': vocab})
    config = ds_config(48 if kind == 'deepseek_v3' else None, kind[-2:])
    config.vocab_size = vocab
    return config


def write_metadata(config, writer: gguf.GGUFWriter) -> None:
    """``config``'s metadata under the keys convert_hf_to_gguf.py writes for its architecture."""
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps)]:
        add(value)
    rope = config.rope_parameters.get('full_attention', config.rope_parameters)
    if config.model_type != 'gemma2':  # Gemma2Model writes no rotary keys
        writer.add_rope_freq_base(rope['rope_theta'])
    if rope['rope_type'] == 'linear':
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope['factor'])
    elif rope['rope_type'] == 'yarn':
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope['factor'])
        writer.add_rope_scaling_orig_ctx_len(rope['original_max_position_embeddings'])
        writer.add_rope_scaling_yarn_beta_fast(rope['beta_fast'])
        writer.add_rope_scaling_yarn_beta_slow(rope['beta_slow'])
    if config.model_type.startswith('deepseek'):
        _deepseek_metadata(config, writer)
        return
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    if config.model_type == 'gemma2':
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.model_type.startswith('gemma'):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == 'gemma3_text':
        writer.add_rope_freq_base_swa(config.rope_parameters['sliding_attention']['rope_theta'])
    if config.model_type == 'gpt_oss':
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.intermediate_size)


def _deepseek_metadata(config, writer: gguf.GGUFWriter) -> None:
    """DeepseekV2Model: MLA as multi-query attention over the latent, the hub configs' ``scoring_func``."""
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    v3 = config.model_type == 'deepseek_v3'
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    writer.add_rope_scaling_yarn_log_mul(0.1 * config.rope_parameters['mscale_all_dim'])


def mxfp4_round_trip(hf: torch.nn.Module) -> dict[str, np.ndarray]:
    """gpt-oss's experts as the converter stores them (gate and up ``[E, I, H]``, down ``[E, H, I]``) in MXFP4,
    and ``hf``'s experts set to what those blocks hold."""
    blocks = {}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(('gate_up_proj', 'down_proj')):
                rows = param.transpose(1, 2).numpy()  # [E, out, in]
                data = gguf.quants.quantize(np.ascontiguousarray(rows), Q.MXFP4)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(data, Q.MXFP4)).transpose(1, 2))
                if name.endswith('down_proj'):
                    blocks[name] = data
                else:  # rows alternate gate and up
                    blocks[name.replace('gate_up', 'gate')] = data[:, ::2]
                    blocks[name.replace('gate_up', 'up')] = data[:, 1::2]
    return blocks


def q8_0_round_trip(hf: torch.nn.Module) -> dict[str, np.ndarray]:
    """``hf``'s decoder projections in Q8_0, and ``hf``'s projections set to what those blocks hold."""
    blocks = {}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(PROJECTIONS):
                blocks[name] = gguf.quants.quantize(param.numpy(), Q.Q8_0)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks[name], Q.Q8_0)))
    return blocks


def converter_tensors(hf: torch.nn.Module, kind: str, blocks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``hf``'s tensors under their Hugging Face names, as the converter reshapes them before naming them
    (``blocks``: quantized ones, as they are)."""
    config, out, quantized = hf.config, dict(blocks), tuple(blocks)
    if kind == 'gpt_oss':
        out = {f'{name}.weight': data for name, data in mxfp4_round_trip(hf).items()}
        quantized = ('experts.gate_up_proj', 'experts.down_proj')
    for name, tensor in hf.state_dict().items():
        data = tensor.numpy()
        if name == 'lm_head.weight' and config.tie_word_embeddings or name.endswith(quantized):
            continue
        if kind.startswith('gemma') and name.endswith('norm.weight'):
            data = data + np.float32(1)
        if kind == 'gpt_oss' and name.endswith('gate_up_proj_bias'):
            out[name.replace('gate_up_proj_bias', 'gate_proj.bias')] = data[:, ::2]
            out[name.replace('gate_up_proj_bias', 'up_proj.bias')] = data[:, 1::2]
        elif kind == 'gpt_oss' and name.endswith(('down_proj_bias', 'sinks')):
            out[name.replace('_bias', '.bias') if name.endswith('bias') else f'{name}.weight'] = data
        elif kind.startswith('deepseek') and name.endswith('gate_up_proj'):
            gate, up = np.split(data, 2, axis=1)
            out[name.replace('gate_up_proj', 'gate_proj.weight')] = gate
            out[name.replace('gate_up_proj', 'up_proj.weight')] = up
        elif kind.startswith('deepseek') and name.endswith('down_proj') and 'experts' in name:
            out[f'{name}.weight'] = data
        elif kind.startswith('deepseek') and name.endswith('e_score_correction_bias'):
            out[name.replace('_bias', '.bias')] = data
        elif kind == 'deepseek_v3' and name.endswith('kv_b_proj.weight'):  # split (V2 test: whole, as before)
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            kv_b = data.reshape(heads, nope + config.v_head_dim, -1)
            out[name.replace('kv_b', 'k_b')] = kv_b[:, :nope].transpose(0, 2, 1)
            out[name.replace('kv_b', 'v_b')] = kv_b[:, nope:]
        else:
            out[name] = data
    return out


def write_gguf(hf: torch.nn.Module, kind: str, writer: gguf.GGUFWriter, blocks: dict[str, np.ndarray]) -> None:
    write_metadata(hf.config, writer)
    names = gguf.get_tensor_name_map(ARCHS[kind], hf.config.num_hidden_layers)
    for name, data in converter_tensors(hf, kind, blocks).items():
        qtype = (Q.Q8_0 if name in blocks else Q.MXFP4) if data.dtype == np.uint8 else None
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data),
                          raw_dtype=qtype)
    finish(writer)


@pytest.mark.parametrize('kind', sorted(ARCHS))
def test_gguf_arch_matches_transformers(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / f'{kind}.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[ARCHS[kind]])
    vocab = _add_tokenizer(writer)
    std = {'gate_up_proj': 4.0} if kind == 'gpt_oss' else {'e_score_correction_bias': 0.1}
    hf = hf_causal_lm(save_random_model(hf_config(kind, vocab), str(tmp_path / 'hf'), std=std))
    write_gguf(hf, kind, writer, {})

    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())  # all dequantized: transformers loads it
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    assert converted.config.architectures == hf.config.architectures
    for field in ('layer_types', 'sliding_window', 'query_pre_attn_scalar', 'rope_parameters', 'q_lora_rank',
                  'attn_logit_softcapping', 'final_logit_softcapping', 'n_group', 'topk_group', 'norm_topk_prob',
                  'routed_scaling_factor', 'first_k_dense_replace', 'num_local_experts', 'n_routed_experts'):
        assert getattr(converted.config, field, None) == getattr(hf.config, field, None), field
    state = hf.state_dict()
    assert converted.state_dict().keys() == state.keys()
    for name, value in converted.state_dict().items():  # Gemma's norms: 1 + weight is what they apply
        exact = 0 if not name.endswith('norm.weight') or kind.startswith(('gpt', 'deepseek')) else 1e-7
        torch.testing.assert_close(value, state[name], rtol=0, atol=exact, msg=name)

    prompts = random_prompts([5, 23, 41], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


def test_gemma_q8_0_projections_kept_as_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's projections all Q8_0: served as llama.cpp's blocks, token for token like transformers on the
    weights those blocks hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'gemma3.gguf'
    writer = gguf.GGUFWriter(str(src), 'gemma3')
    vocab = _add_tokenizer(writer)
    hf = hf_causal_lm(save_random_model(hf_config('gemma3', vocab), str(tmp_path / 'hf')))
    write_gguf(hf, 'gemma3', writer, q8_0_round_trip(hf))

    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    assert len(layer_types) == 2 * hf.config.num_hidden_layers * 2 and set(layer_types.values()) == {'Q8_0'}
    prompts = random_prompts([5, 41], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
