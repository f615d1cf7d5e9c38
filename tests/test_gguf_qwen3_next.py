"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE from GGUF (llama.cpp's ``qwen3next``, ``qwen35``, ``qwen35moe``): tiny random
hybrid models written as convert_hf_to_gguf.py's ``Qwen3NextModel``, ``Qwen3_5TextModel`` and ``Qwen3_5MoeTextModel``
write them (norms as ``1 + weight``, ``A_log`` as ``-exp(A_log)``, the convolution squeezed, Qwen3-Next's
``in_proj_qkvz`` split into ``attn_qkv`` and ``attn_gate``, Qwen3.5's value heads tiled, a next-token-prediction
block past the decoder's), in F32 and Q4_K_M-like (Q4_K, Q6_K and Q8_0 projections, kept as their blocks), served
token for token like transformers on the weights the file holds."""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

from conftest import save_random_model
from family_checks import assert_batched_equals_solo_and_frees, assert_matches_transformers, hf_causal_lm
from helpers import assert_same_state, assert_transformers_greedy, make_engine, random_prompts
from test_gguf import CHAT_TEMPLATE, _add_tokenizer, finish
from test_gguf_mixed import encode

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant.gguf import GgufFormat, GgufPartsFormat
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf
from lmdeploy.tokenizer import Tokenizer

# three linear-attention layers, then a full-attention one; two key heads serve four value heads
SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
             linear_conv_kernel_dim=4, max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=None)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
# every linear layer's inputs in whole K-quant blocks (256): a value head of 64 features, a quarter of a block
WIDE = dict(hidden_size=256, head_dim=64, linear_value_head_dim=64)
WIDE_MOE = dict(moe_intermediate_size=256, shared_expert_intermediate_size=256)
VARIANTS = {
    'qwen3next': lambda vocab, wide: Qwen3NextConfig(**(SHAPE | MOE | (WIDE | WIDE_MOE if wide else {})),
                                                     intermediate_size=256 if wide else 64, vocab_size=vocab),
    'qwen35': lambda vocab, wide: Qwen3_5TextConfig(**(SHAPE | (WIDE if wide else {})),
                                                    intermediate_size=256 if wide else 64, vocab_size=vocab),
    'qwen35moe': lambda vocab, wide: Qwen3_5MoeTextConfig(**(SHAPE | MOE | (WIDE | WIDE_MOE if wide else {})),
                                                          vocab_size=vocab),
}
ARCHS = {'qwen3next': gguf.MODEL_ARCH.QWEN3NEXT, 'qwen35': gguf.MODEL_ARCH.QWEN35,
         'qwen35moe': gguf.MODEL_ARCH.QWEN35MOE}
_F32_TENSORS = ('_norm.weight', 'ffn_gate_inp.weight', 'ffn_gate_inp_shexp.weight', 'ssm_conv1d.weight')
# Q4_K_M-like (llama.cpp's Q4_K, with Q6_K in some attn_v and ffn_down and the output), Q8_0 and Q6_K besides: the
# full-attention layer's q/k/v of Q4_K, Q4_K and Q6_K (kept part by part); layer 0's attn_qkv Q5_K, as llama.cpp's
# Q4_K_M writes Qwen3.5's
MIXED = {'output': Q.Q6_K, 'blk.3.attn_v': Q.Q6_K, 'blk.3.attn_output': Q.Q8_0, 'blk.0.ffn_down': Q.Q6_K,
         'blk.0.ffn_down_shexp': Q.Q6_K, 'blk.1.ffn_down_exps': Q.Q6_K, 'blk.1.attn_qkv': Q.Q8_0,
         'blk.1.attn_gate': Q.Q6_K, 'blk.2.ssm_out': Q.Q8_0, 'blk.0.attn_qkv': Q.Q5_K, 'default': Q.Q4_K}
MIXED_LAYERS = {'layers.3.self_attn.qkv_proj': ['Q4_K', 'Q4_K', 'Q6_K'], 'layers.3.self_attn.o_proj': 'Q8_0',
                'layers.0.mlp.down_proj': 'Q6_K', 'layers.0.mlp.shared_expert.down_proj': 'Q6_K',
                'layers.1.mlp.experts.down': 'Q6_K', 'layers.1.linear_attn.in_proj_qkv': 'Q8_0',
                'layers.1.linear_attn.in_proj_z': 'Q6_K', 'layers.2.linear_attn.out_proj': 'Q8_0',
                'layers.0.linear_attn.in_proj_qkv': 'Q5_K'}

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


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


def stored(data: np.ndarray, gguf_name: str, types: dict[str, Q], rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    """The type of ``types`` for the tensor (by its name less ``.weight``, else ``default``): 1-D tensors, norms,
    routers, the convolution and tensors without a ``.weight`` kind (``ssm_a``) in F32 as the converter keeps them;
    K-quants random blocks (``test_gguf_mixed.encode``)."""
    qtype = types.get(gguf_name.removesuffix('.weight'), types['default'])
    if qtype == Q.F32 or data.ndim <= 1 or gguf_name.endswith(_F32_TENSORS) or not gguf_name.endswith('.weight'):
        return np.ascontiguousarray(data, dtype=np.float32), Q.F32
    return encode(np.ascontiguousarray(data), qtype, rng), qtype


def held(name: str, value: torch.Tensor) -> torch.Tensor:
    """What an F32 file gives back for ``hf``'s parameter ``name``: the norms' ``1 + w`` and ``A_log``'s ``-exp``
    undone in float32."""
    if name.endswith('.A_log'):
        return torch.log(torch.exp(value))
    if name.endswith('norm.weight') and not name.endswith('linear_attn.norm.weight'):
        return (value + 1) - 1
    return value


def write_text_model(writer: gguf.GGUFWriter, state_dict: dict[str, torch.Tensor], config, variant: str,
                     types: dict[str, Q] | None = None) -> None:
    """A text checkpoint's metadata and tensors (and a next-token-prediction block past the decoder's) as the
    converter writes them, of ``types`` (see :func:`stored`; all F32 by default), after the vocabulary already in
    ``writer``."""
    write_metadata(config, writer, variant)
    names = gguf.get_tensor_name_map(ARCHS[variant], config.num_hidden_layers + 1)
    rng = np.random.default_rng(0)
    for name, data in converter_tensors(state_dict, config, variant).items():
        gguf_name = name if name.startswith('blk.') else names.get_name(name, try_suffixes=('.weight', '.bias'))
        array, array_type = stored(data.numpy(), gguf_name, types or {'default': Q.F32}, rng)
        writer.add_tensor(gguf_name, array, raw_dtype=array_type if array.dtype == np.uint8 else None)
    writer.add_tensor(f'blk.{config.num_hidden_layers}.nextn.enorm.weight',
                      np.ones(config.hidden_size, dtype=np.float32))
    finish(writer)


def random_hybrid(path: Path, variant: str, types: dict[str, Q] | None = None) -> torch.nn.Module:
    """A tiny random model of ``variant`` written to ``path / 'model.gguf'`` as the converter writes it, in F32
    (transformers' model of the weights the file holds returned) or of ``types`` (of K-quant widths; the random
    model returned, not the file's weights)."""
    writer = gguf.GGUFWriter(str(path / 'model.gguf'), variant)
    vocab = _add_tokenizer(writer)
    writer.add_tokenizer_pre('qwen35' if variant != 'qwen3next' else 'qwen2')
    hf = hf_causal_lm(save_random_model(VARIANTS[variant](vocab, types is not None), str(path / 'hf')))
    write_text_model(writer, hf.state_dict(), hf.config, variant, types)
    with torch.no_grad():
        for name, param in hf.state_dict().items():
            param.copy_(held(name, param))
    return hf



@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_f32_file_is_the_checkpoint_and_matches_transformers(tmp_path: Path, variant: str) -> None:
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
    assert_same_state(converted, hf)
    assert_matches_transformers(str(src), hf, random_prompts([9, 70], seed=1, vocab=hf.config.vocab_size),
                                random_prompts([5, 33], seed=2, vocab=hf.config.vocab_size))


def layer_types(model: torch.nn.Module) -> dict[str, str | list[str]]:
    """Each linear layer's GGUF type (a list, part by part, for a stacked layer of several), each MoE layer's
    experts' by projection (``layers.1.mlp.experts.down``), ``dense`` for those held in the model's dtype."""
    def name(weight_format) -> str:
        return weight_format.ggml_type if isinstance(weight_format, GgufFormat) else 'dense'

    types = {}
    for module_name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            for proj in ('gate_up', 'down'):
                types[f'{module_name}.{proj}'] = name(module.weight_format.expert_format(proj))
        elif isinstance(module, Linear):
            layer_format = module.weight_format
            types[module_name] = ([part.ggml_type for part in layer_format.parts]
                                  if isinstance(layer_format, GgufPartsFormat) else name(layer_format))
    return types


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_quantized_projections_stay_blocks_and_match_transformers(tmp_path: Path, variant: str) -> None:
    """A Q4_K_M-like file (:data:`MIXED`): every projection of the linear attention (but its one-row-per-head b and
    a), of the gated full attention, of the MLP, shared expert and experts is held as the file's blocks, of the
    file's type; only those b and a, the routers and the shared expert's gate are dense. In fp32 the greedy tokens
    equal transformers' on the file's weights (the folder dequantized for transformers), batched as alone; every
    KV block comes back."""
    random_hybrid(tmp_path, variant, MIXED)
    src = str(tmp_path / 'model.gguf')
    convert_gguf(src, str(tmp_path / 'dense'), raw_types=())
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'dense'), dtype=torch.float32).eval()
    engine = make_engine(src)
    try:
        types = layer_types(engine.runner.model)
        dense = {name for name, kind in types.items() if kind == 'dense'}
        routers = {f'layers.{i}.mlp.{gate}' for i in range(4) for gate in ('gate', 'shared_expert_gate')}
        assert dense == {f'layers.{i}.linear_attn.in_proj_{p}' for i in range(3) for p in 'ab'} | (
            routers if variant != 'qwen35' else set())
        assert {name: kind for name, kind in types.items() if name in MIXED_LAYERS} == {
            name: kind for name, kind in MIXED_LAYERS.items() if name in types}
        assert {kind for name, kind in types.items() if name not in MIXED_LAYERS | dict.fromkeys(dense)} == {'Q4_K'}
        assert engine.model_config.hf_config.quantization_config['lm_head'] == 'Q6_K'
        prompts, batched = assert_batched_equals_solo_and_frees(engine, reference.config.vocab_size)
    finally:
        engine.close()
    assert_transformers_greedy(reference, prompts, batched)


def test_chat_template_and_tokenizer_come_from_the_file(tmp_path: Path) -> None:
    random_hybrid(tmp_path, 'qwen35')
    tokenizer = Tokenizer(resolve_gguf(str(tmp_path / 'model.gguf')))
    assert tokenizer.hf.chat_template == CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template([{'role': 'user', 'content': 'hello world'}])
    assert prompt.startswith('<|im_start|>user\nhello world<|im_end|>')
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert tokenizer.eos_token_ids == {len(tokenizer.hf) - 1}


def test_file_without_its_linear_attention_heads_is_refused(tmp_path: Path, tmp_gguf_cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp requires ``ssm.group_count`` (the linear attention's key heads): a file without it is refused,
    naming the key, and leaves nothing in the cache."""
    monkeypatch.setattr(gguf.GGUFWriter, 'add_ssm_group_count', lambda writer, count: None)
    random_hybrid(tmp_path, 'qwen35')
    with pytest.raises(ConfigError, match='ssm.group_count'):
        resolve_gguf(str(tmp_path / 'model.gguf'))
    assert not (tmp_gguf_cache / 'gguf').exists() or not list((tmp_gguf_cache / 'gguf').iterdir())
