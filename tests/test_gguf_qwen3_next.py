"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE from GGUF (llama.cpp's ``qwen3next``, ``qwen35``, ``qwen35moe``): tiny random
hybrid models written as convert_hf_to_gguf.py's ``Qwen3NextModel``, ``Qwen3_5TextModel`` and ``Qwen3_5MoeTextModel``
write them (norms as ``1 + weight``, ``A_log`` as ``-exp(A_log)``, the convolution squeezed, Qwen3-Next's
``in_proj_qkvz`` split into ``attn_qkv`` and ``attn_gate``, Qwen3.5's value heads tiled, a next-token-prediction
block past the decoder's), in F32 and Q8_0, served token for token like transformers on the weights the file
holds."""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

from conftest import save_random_model
from family_checks import assert_matches_transformers, hf_causal_lm
from helpers import hf_greedy, make_engine, random_prompts, run
from test_gguf import CHAT_TEMPLATE, _add_tokenizer, finish

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf
from lmdeploy.tokenizer import Tokenizer

# three linear-attention layers, then a full-attention one; two key heads serve four value heads; widths of whole
# Q8_0 blocks (32 inputs), value heads of one block each (so that tiling the out_proj's columns moves whole blocks)
SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
             linear_conv_kernel_dim=4, max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=None)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
VARIANTS = {
    'qwen3next': lambda vocab: Qwen3NextConfig(intermediate_size=64, vocab_size=vocab, **MOE, **SHAPE),
    'qwen35': lambda vocab: Qwen3_5TextConfig(intermediate_size=64, vocab_size=vocab, **SHAPE),
    'qwen35moe': lambda vocab: Qwen3_5MoeTextConfig(vocab_size=vocab, **MOE, **SHAPE),
}
ARCHS = {'qwen3next': gguf.MODEL_ARCH.QWEN3NEXT, 'qwen35': gguf.MODEL_ARCH.QWEN35,
         'qwen35moe': gguf.MODEL_ARCH.QWEN35MOE}
_F32_TENSORS = ('_norm.weight', 'ffn_gate_inp.weight', 'ffn_gate_inp_shexp.weight', 'ssm_conv1d.weight')


def write_metadata(config, writer: gguf.GGUFWriter, variant: str) -> None:
    """TextModel's keys, Qwen2MoeModel's expert widths, Qwen3NextModel's ``ssm.*``, layer kinds, full-attention
    interval and rotary width, Qwen3.5's M-RoPE sections; one next-token-prediction layer (counted in
    ``block_count``)."""
    for add, value in [(writer.add_block_count, config.num_hidden_layers + 1),
                       (writer.add_nextn_predict_layers, 1),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_ssm_conv_kernel, config.linear_conv_kernel_dim),
                       (writer.add_ssm_state_size, config.linear_key_head_dim),
                       (writer.add_ssm_group_count, config.linear_num_key_heads),
                       (writer.add_ssm_time_step_rank, config.linear_num_value_heads),
                       (writer.add_ssm_inner_size, config.linear_value_head_dim * config.linear_num_value_heads),
                       (writer.add_full_attention_interval, 4),
                       (writer.add_rope_dimension_count,
                        int(config.head_dim * config.rope_parameters['partial_rotary_factor']))]:
        add(value)
    writer.add_array(f'{variant}.attention.recurrent_layers',
                     [t == 'linear_attention' for t in config.layer_types] + [False])
    if getattr(config, 'intermediate_size', None):
        writer.add_feed_forward_length(config.intermediate_size)
    if variant != 'qwen35':
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if variant != 'qwen3next':
        writer.add_rope_dimension_sections(config.rope_parameters.get('mrope_section', [11, 11, 10]) + [0])


def tiled(tensor: torch.Tensor, dim: int, config, head_dim: int) -> torch.Tensor:
    """``_reorder_v_heads``: value heads grouped by key head to tiled."""
    shape, k_heads = list(tensor.shape), config.linear_num_key_heads
    split = tensor.reshape(*shape[:dim], k_heads, -1, head_dim, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape)


def linear_attention(name: str, data: torch.Tensor, config) -> torch.Tensor:
    """``_LinearAttentionVReorderBase.modify_tensors`` (Qwen3.5: value heads tiled)."""
    keys, v_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim, config.linear_value_head_dim
    if name.endswith(('in_proj_qkv.weight', 'conv1d.weight')):
        return torch.cat((data[:keys], tiled(data[keys:], 0, config, v_dim)))
    if name.endswith('in_proj_z.weight'):
        return tiled(data, 0, config, v_dim)
    if name.endswith(('in_proj_a.weight', 'in_proj_b.weight', 'A_log', 'dt_bias')):
        return tiled(data, 0, config, 1)
    if name.endswith('out_proj.weight'):
        return tiled(data, 1, config, v_dim)
    return data


def converter_tensors(state_dict: dict[str, torch.Tensor], config, variant: str) -> dict[str, torch.Tensor]:
    """A text checkpoint's tensors (of ``config``) as the converter hands them to gguf-py's name map (or, Qwen3-Next's
    split ``in_proj_qkvz``, by their GGUF names)."""
    out = {}
    for name, data in state_dict.items():
        if variant != 'qwen3next' and config.linear_num_key_heads != config.linear_num_value_heads:
            data = linear_attention(name, data, config)
        if name.endswith('.A_log'):
            data = -torch.exp(data)
        elif name.endswith('.dt_bias'):
            name = name.replace('.dt_bias', '.dt_proj.bias')
        elif 'conv1d' in name:
            data = data.squeeze()
        elif name.endswith('norm.weight') and not name.endswith('linear_attn.norm.weight'):
            data = data + 1
        if name.endswith('experts.gate_up_proj'):
            gate, up = data.chunk(2, dim=-2)
            out[name.replace('gate_up_proj', 'gate_proj.weight')] = gate
            out[name.replace('gate_up_proj', 'up_proj.weight')] = up
        elif name.endswith('experts.down_proj'):
            out[f'{name}.weight'] = data
        elif name.endswith('in_proj_qkvz.weight'):
            layer = name.split('.')[2]
            k_dim = config.linear_key_head_dim
            v_dim = config.linear_value_head_dim * config.linear_num_value_heads // config.linear_num_key_heads
            per_head = data.reshape(config.linear_num_key_heads, -1, data.shape[-1])
            q, k, v, z = per_head.split([k_dim, k_dim, v_dim, v_dim], dim=1)
            out[f'blk.{layer}.attn_qkv.weight'] = torch.cat([p.flatten(0, 1) for p in (q, k, v)])
            out[f'blk.{layer}.attn_gate.weight'] = z.flatten(0, 1)
        else:
            out[name] = data
    return _stacked_experts(out)


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Experts saved one tensor per expert stacked as ``Qwen2MoeModel.modify_tensors`` stacks them."""
    out, experts = {}, {}
    for name, data in tensors.items():
        match = re.fullmatch(r'(.*\.experts)\.(\d+)\.(\w+)\.weight', name)
        if match:
            experts.setdefault(f'{match[1]}.{match[3]}.weight', {})[int(match[2])] = data
        else:
            out[name] = data
    return out | {name: torch.stack([parts[e] for e in sorted(parts)]) for name, parts in experts.items()}


def stored(data: np.ndarray, gguf_name: str, qtype: Q) -> tuple[np.ndarray, Q]:
    """The converter's choice for ``--outtype`` ``qtype``: 1-D tensors, norms, routers, the convolution and tensors
    without a ``.weight`` kind (``ssm_a``) in F32, the rest in ``qtype``."""
    if qtype == Q.F32 or data.ndim <= 1 or gguf_name.endswith(_F32_TENSORS) or not gguf_name.endswith('.weight'):
        return np.ascontiguousarray(data, dtype=np.float32), Q.F32
    return gguf.quants.quantize(np.ascontiguousarray(data), qtype), qtype


def held(name: str, value: torch.Tensor, qtype: Q) -> torch.Tensor:
    """What the engine reads back for ``hf``'s parameter ``name``: rounded through Q8_0 where the file quantizes it
    (row blocks: the converter's row and whole-block column reorders leave them intact), the norms' ``1 + w`` and
    ``A_log``'s ``-exp`` undone in float32."""
    if name.endswith('.A_log'):
        return torch.log(torch.exp(value))
    if name.endswith('norm.weight') and not name.endswith('linear_attn.norm.weight'):
        return (value + 1) - 1
    kept_f32 = name.endswith(('mlp.gate.weight', 'shared_expert_gate.weight')) or 'conv1d' in name
    if qtype == Q.F32 or value.ndim <= 1 or kept_f32:
        return value
    blocks = gguf.quants.quantize(np.ascontiguousarray(value.numpy()), qtype)
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(value.shape))


def write_text_model(writer: gguf.GGUFWriter, state_dict: dict[str, torch.Tensor], config, variant: str,
                     qtype: Q = Q.F32) -> None:
    """A text checkpoint's metadata and tensors (and a next-token-prediction block past the decoder's) as the
    converter writes them with ``--outtype`` ``qtype``, after the vocabulary already in ``writer``."""
    write_metadata(config, writer, variant)
    names = gguf.get_tensor_name_map(ARCHS[variant], config.num_hidden_layers + 1)
    for name, data in converter_tensors(state_dict, config, variant).items():
        gguf_name = name if name.startswith('blk.') else names.get_name(name, try_suffixes=('.weight', '.bias'))
        array, array_type = stored(data.numpy(), gguf_name, qtype)
        writer.add_tensor(gguf_name, array, raw_dtype=array_type if array.dtype == np.uint8 else None)
    writer.add_tensor(f'blk.{config.num_hidden_layers}.nextn.enorm.weight',
                      np.ones(config.hidden_size, dtype=np.float32))
    finish(writer)


def random_hybrid(path: Path, variant: str, qtype: Q = Q.F32) -> torch.nn.Module:
    """A tiny random model of ``variant`` written to ``path / 'model.gguf'`` as the converter writes it with
    ``--outtype`` ``qtype``; transformers' model of the weights the file holds."""
    writer = gguf.GGUFWriter(str(path / 'model.gguf'), variant)
    vocab = _add_tokenizer(writer)
    writer.add_tokenizer_pre('qwen35' if variant != 'qwen3next' else 'qwen2')
    hf = hf_causal_lm(save_random_model(VARIANTS[variant](vocab), str(path / 'hf')))
    write_text_model(writer, hf.state_dict(), hf.config, variant, qtype)
    with torch.no_grad():
        for name, param in hf.state_dict().items():
            param.copy_(held(name, param, qtype))
    return hf


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    return tmp_path / 'cache'


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_f32_file_is_the_checkpoint_and_matches_transformers(tmp_path: Path, cache: Path, variant: str) -> None:
    """Converted with every tensor dequantized, the folder is transformers' checkpoint of what the file holds (config
    fields and weights, bit for bit; the next-token-prediction block left out); the engine's 32 greedy tokens and
    first-step logits equal transformers'."""
    hf = random_hybrid(tmp_path, variant)
    src = tmp_path / 'model.gguf'
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    for field in ('architectures', 'model_type', 'num_hidden_layers', 'layer_types', 'head_dim', 'linear_num_key_heads',
                  'linear_num_value_heads', 'linear_key_head_dim', 'linear_value_head_dim', 'linear_conv_kernel_dim',
                  'num_experts', 'num_experts_per_tok', 'moe_intermediate_size', 'shared_expert_intermediate_size',
                  'norm_topk_prob', 'tie_word_embeddings'):
        assert getattr(converted.config, field, None) == getattr(hf.config, field, None), field
    for field in ('partial_rotary_factor', 'rope_theta'):
        assert converted.config.rope_parameters[field] == hf.config.rope_parameters[field], field
    # Qwen3.5's sections: transformers' default where the checkpoint has none, as the converter writes them
    assert converted.config.rope_parameters.get('mrope_section') == (None if variant == 'qwen3next' else [11, 11, 10])
    state = hf.state_dict()
    assert converted.state_dict().keys() == state.keys()
    for name, value in converted.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
    assert_matches_transformers(str(src), hf, random_prompts([9, 70], seed=1, vocab=hf.config.vocab_size),
                                random_prompts([5, 33], seed=2, vocab=hf.config.vocab_size))


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_q8_0_file_matches_transformers(tmp_path: Path, cache: Path, variant: str) -> None:
    """A Q8_0 file: the routed experts kept as their blocks, one tensor per expert (the hybrid layers' other
    projections are dequantized); greedy tokens equal transformers' on the weights the file holds."""
    hf = random_hybrid(tmp_path, variant, Q.Q8_0)
    src = str(tmp_path / 'model.gguf')
    engine = make_engine(src)
    kept = getattr(engine.model_config.hf_config, 'quantization_config', {}).get('ggml_types', {})
    if variant == 'qwen35':
        assert kept == {}
    else:
        assert kept == {f'layers.{i}.mlp.experts.{proj}': 'Q8_0' for i in range(4)
                        for proj in ('gate_up_proj', 'down_proj')}
        index = json.loads((Path(resolve_gguf(src)) / 'model.safetensors.index.json').read_text())
        assert 'model.layers.0.mlp.experts.3.down_proj.qweight' in index['weight_map']
    prompts = random_prompts([6, 41], seed=3, vocab=hf.config.vocab_size)
    assert run(engine, prompts) == [hf_greedy(hf, p) for p in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chat_template_and_tokenizer_come_from_the_file(tmp_path: Path, cache: Path) -> None:
    random_hybrid(tmp_path, 'qwen35')
    tokenizer = Tokenizer(resolve_gguf(str(tmp_path / 'model.gguf')))
    assert tokenizer.hf.chat_template == CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template([{'role': 'user', 'content': 'hello world'}])
    assert prompt.startswith('<|im_start|>user\nhello world<|im_end|>')
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert tokenizer.eos_token_ids == {len(tokenizer.hf) - 1}


def test_file_without_its_linear_attention_heads_is_refused(tmp_path: Path, cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp requires ``ssm.group_count`` (the linear attention's key heads): a file without it is refused,
    naming the key, and leaves nothing in the cache."""
    monkeypatch.setattr(gguf.GGUFWriter, 'add_ssm_group_count', lambda writer, count: None)
    random_hybrid(tmp_path, 'qwen35')
    with pytest.raises(ConfigError, match='ssm.group_count'):
        resolve_gguf(str(tmp_path / 'model.gguf'))
    assert not (cache / 'gguf').exists() or not list((cache / 'gguf').iterdir())
