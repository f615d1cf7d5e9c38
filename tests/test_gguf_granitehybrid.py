"""Granite 4.0-H from GGUF (llama.cpp's ``granitehybrid``): tiny random ``GraniteMoeHybridForCausalLM`` models (Mamba-2
and attention layers; routed experts with the shared MLP, or the shared MLP alone) written as convert_hf_to_gguf.py's
``GraniteHybridModel`` writes them (``Mamba2Model``'s tensors: ``-exp(A_log)``, ``D`` and ``A`` as ``[heads, 1]``, the
convolution squeezed, the gated norm ``[groups, inner / groups]``; q/k rows permuted; the MoE's and shared MLP's
fused ``input_linear`` split; per-layer ``head_count_kv``), read back into the checkpoint bit for bit and served token
for token like transformers; a Q8_0 file's projections (attention, Mamba-2 in/out, shared MLP, experts) served as
their blocks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig

from conftest import save_random_model
from family_checks import assert_batched_equals_solo_and_frees, assert_matches_transformers, hf_causal_lm
from helpers import assert_same_state, assert_transformers_greedy, make_engine, random_prompts
from test_gguf import _add_tokenizer, finish, llama_permute
from test_gguf_qwen3_next import layer_types

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, mamba_d_state=16, mamba_d_conv=4,
             mamba_expand=2, mamba_d_head=16, max_position_embeddings=1024, embedding_multiplier=12.0,
             logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0156, rms_norm_eps=1e-6,
             pad_token_id=None, architectures=['GraniteMoeHybridForCausalLM'])
VARIANTS = {
    # Granite 4.0-H Tiny/Small: routed experts beside the shared MLP, attention without positions, two B/C groups
    'moe': lambda vocab: GraniteMoeHybridConfig(
        num_hidden_layers=4, layer_types=['mamba', 'attention', 'mamba', 'mamba'], intermediate_size=32,
        shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2,
        position_embedding_type='nope', tie_word_embeddings=False, vocab_size=vocab, **SHAPE),
    # Granite 4.0-H Micro/1B: the shared MLP alone, rotary attention (as a file that sets rope.scaling.finetuned),
    # one group, the LM head tied to the embeddings
    'dense': lambda vocab: GraniteMoeHybridConfig(
        num_hidden_layers=3, layer_types=['mamba', 'mamba', 'attention'], intermediate_size=96,
        shared_intermediate_size=96,
        num_local_experts=0, mamba_n_heads=8, mamba_n_groups=1, position_embedding_type='rope',
        tie_word_embeddings=True, vocab_size=vocab, **SHAPE),
}

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def mamba2_tensor(name: str, data: torch.Tensor, groups: int) -> tuple[str, torch.Tensor]:
    """``Mamba2Model.modify_tensors``: ``dt_bias`` as ``dt_proj.bias``, the convolution squeezed, ``A`` and ``D`` as
    ``[heads, 1]`` (``A`` as ``-exp(A_log)``), the gated norm as ``[groups, inner / groups]``."""
    if name.endswith('.dt_bias'):
        return name.replace('.dt_bias', '.dt_proj.bias'), data
    if name.endswith('conv1d.weight'):
        return name, data.squeeze()
    if name.endswith('.A_log'):
        return name, -torch.exp(data).reshape(-1, 1)
    if name.endswith('.D'):
        return name, data.reshape(-1, 1)
    if name.endswith(('mamba.norm.weight', 'mixer.norm.weight')):
        return name, data.reshape(groups, -1)
    return name, data


def add_mamba2_metadata(writer: gguf.GGUFWriter, heads: int, head_dim: int, groups: int, state: int, kernel: int,
                        kv_heads: list[int]) -> None:
    """``GraniteHybridModel.set_gguf_parameters``' Mamba-2 keys and its per-layer ``head_count_kv``."""
    writer.add_ssm_conv_kernel(kernel)
    writer.add_ssm_state_size(state)
    writer.add_ssm_group_count(groups)
    writer.add_ssm_inner_size(heads * head_dim)
    writer.add_ssm_time_step_rank(heads)
    writer.add_head_count_kv(kv_heads)


# the checkpoint's linear layers (not the routers, embeddings and LM head) and their GGUF tensors
QUANTIZED = ('proj.weight', 'input_linear.weight', 'output_linear.weight')
_QUANTIZED_MODULES = ('attn_q', 'attn_k', 'attn_v', 'attn_output', 'ssm_in', 'ssm_out', 'ffn_up', 'ffn_gate',
                      'ffn_down', 'ffn_latent')


def q8_0_values(tensor: torch.Tensor) -> torch.Tensor:
    """What Q8_0 blocks of ``tensor`` hold: row by row, the same blocks before or after the converter's row
    permutations, splits and stacks."""
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), Q.Q8_0), Q.Q8_0))


def write_gguf(writer: gguf.GGUFWriter, folder: str, quantize: bool,
               convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """The checkpoint in ``folder`` written as ``convert`` (the converter's steps, to gguf-py's names) gives it,
    its projections as Q8_0 blocks where ``quantize``; the checkpoint rewritten with what the file holds (the
    blocks' values, ``A_log`` through ``log(-(-exp))`` in fp32)."""
    path = Path(folder) / 'model.safetensors'
    state = load_file(str(path))
    if quantize:
        state = {name: q8_0_values(t) if name.endswith(QUANTIZED) else t for name, t in state.items()}
    for name, data in convert(dict(state)).items():
        array = np.ascontiguousarray(data.numpy())
        if quantize and array.ndim >= 2 and name.split('.')[-2].startswith(_QUANTIZED_MODULES) and not name.split(
                '.')[-2].startswith('ffn_gate_inp'):
            array = gguf.quants.quantize(array, Q.Q8_0)
        writer.add_tensor(name, array, raw_dtype=Q.Q8_0 if array.dtype == np.uint8 else None)
    state = {name: torch.log(torch.exp(t)) if name.endswith('.A_log') else t for name, t in state.items()}
    save_file(state, str(path), metadata={'format': 'pt'})


def converter_arrays(config, name: str, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """``GraniteHybridModel.modify_tensors``: the fused MoE and shared-MLP ``input_linear`` split into gate and up
    (the shared MLP's as ``ffn_*`` without experts), the Mamba-2 layers' tensors as ``Mamba2Model``'s, q/k rows
    permuted as Llama's; by gguf-py's names."""
    experts, layer = config.num_local_experts, name.split('.')[2] if '.layers.' in name else None
    if name.endswith('block_sparse_moe.input_linear.weight'):
        gate, up = data.chunk(2, dim=-2)
        return {f'blk.{layer}.ffn_gate_exps.weight': gate, f'blk.{layer}.ffn_up_exps.weight': up}
    if name.endswith('shared_mlp.input_linear.weight'):
        gate, up = data.chunk(2, dim=-2)
        suffix = '_shexp' if experts else ''
        return {f'blk.{layer}.ffn_gate{suffix}.weight': gate, f'blk.{layer}.ffn_up{suffix}.weight': up}
    if name.endswith('shared_mlp.output_linear.weight') and not experts:
        return {f'blk.{layer}.ffn_down.weight': data}
    name, data = mamba2_tensor(name, data, config.mamba_n_groups)
    if name.endswith(('q_proj.weight', 'k_proj.weight')):
        heads = config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads
        data = torch.from_numpy(llama_permute(data.numpy(), heads))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, config.num_hidden_layers)
    return {names.get_name(name, try_suffixes=('.weight', '.bias')): data}


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """TextModel's, LlamaModel's (rotary width hidden / heads: Granite drops ``head_dim``), GraniteModel's scales,
    GraniteMoeModel's shared width and ``GraniteHybridModel``'s Mamba-2 keys, per-layer ``head_count_kv`` and rotary
    flag (with no rotary the context is llama.cpp's unbounded 2**20)."""
    rotary = config.position_embedding_type == 'rope'
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings if rotary else 2**20),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_expert_count, config.num_local_experts),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_vocab_size, config.vocab_size),
                       (writer.add_rope_dimension_count, config.hidden_size // config.num_attention_heads),
                       (writer.add_attention_scale, config.attention_multiplier),
                       (writer.add_embedding_scale, config.embedding_multiplier),
                       (writer.add_residual_scale, config.residual_multiplier),
                       (writer.add_logit_scale, config.logits_scaling),
                       (writer.add_expert_shared_feed_forward_length, config.shared_intermediate_size),
                       (writer.add_rope_scaling_finetuned, rotary)]:
        add(value)
    add_mamba2_metadata(writer, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                        config.mamba_d_state, config.mamba_d_conv,
                        [config.num_key_value_heads if kind == 'full_attention' else 0 for kind in config.layer_types])


def save_gguf(variant: str, path: Path, quantize: bool = False) -> tuple[Path, str]:
    """A tiny random ``variant`` saved in ``path / 'hf'`` (rewritten with the values the file holds) and written to
    ``path / 'model.gguf'`` (projections as Q8_0 where ``quantize``)."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), 'granitehybrid')
    vocab = _add_tokenizer(writer)
    folder = save_random_model(VARIANTS[variant](vocab), str(path / 'hf'))
    config = hf_causal_lm(folder).config
    add_metadata(writer, config)
    write_gguf(writer, folder, quantize,
               lambda state: {k: v for name, t in state.items() for k, v in converter_arrays(config, name, t).items()})
    finish(writer)
    return src, folder



@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_f32_file_is_the_checkpoint_and_matches_transformers(variant: str, tmp_path: Path) -> None:
    """Converted with every tensor dequantized, the folder is the checkpoint (config fields and every tensor bit for
    bit, ``A_log`` as the file holds it); the engine's 32 greedy tokens and first-step logits equal transformers'."""
    src, folder = save_gguf(variant, tmp_path)
    hf = hf_causal_lm(folder)
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    for field in ('architectures', 'model_type', 'num_hidden_layers', 'layer_types', 'num_key_value_heads',
                  'position_embedding_type', 'num_local_experts', 'num_experts_per_tok', 'intermediate_size',
                  'shared_intermediate_size', 'mamba_n_heads', 'mamba_d_head', 'mamba_n_groups', 'mamba_d_state',
                  'mamba_d_conv', 'mamba_expand', 'mamba_conv_bias', 'mamba_proj_bias', 'tie_word_embeddings'):
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    for field in ('attention_multiplier', 'embedding_multiplier', 'residual_multiplier', 'logits_scaling',
                  'rms_norm_eps'):  # float32 in the file
        assert getattr(converted.config, field) == pytest.approx(getattr(hf.config, field), rel=1e-6), field
    assert_same_state(converted, hf)
    vocab = hf.config.vocab_size
    assert_matches_transformers(str(src), hf, random_prompts([9, 70], seed=1, vocab=vocab),
                                random_prompts([5, 33], seed=2, vocab=vocab))


def test_q8_0_projections_stay_blocks_and_match_transformers(tmp_path: Path) -> None:
    """Every projection in Q8_0 is held as its blocks (attention q/k/v and output, the Mamba-2 in and out projections,
    the shared MLP, the experts); only the routers are dense. In fp32 the greedy tokens equal transformers' on the
    weights the blocks hold, batched as alone; every KV block and recurrent-state slot comes back."""
    src, folder = save_gguf('moe', tmp_path, quantize=True)
    hf = hf_causal_lm(folder)
    engine = make_engine(str(src))
    try:
        types = layer_types(engine.runner.model)
        assert {name for name, kind in types.items() if kind == 'dense'} == {f'layers.{i}.mlp.gate' for i in range(4)}
        assert set(types.values()) - {'dense'} == {'Q8_0'}
        for i, kind in enumerate(hf.config.layer_types):
            mixer = (['mamba.in_proj', 'mamba.out_proj'] if kind == 'linear_attention' else
                     ['self_attn.qkv_proj', 'self_attn.o_proj'])
            expected = mixer + ['shared_mlp.gate_up_proj', 'shared_mlp.down_proj', 'mlp.experts.gate_up',
                                'mlp.experts.down']
            assert all(types[f'layers.{i}.{name}'] == 'Q8_0' for name in expected), (i, types)
        prompts, batched = assert_batched_equals_solo_and_frees(engine, hf.config.vocab_size)
    finally:
        engine.close()
    assert_transformers_greedy(hf, prompts, batched)


def test_file_without_its_mamba2_groups_is_refused(tmp_path: Path, tmp_gguf_cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp requires ``ssm.group_count`` (the Mamba-2 layers' B/C groups): a file without it is refused, naming
    the key, and leaves nothing in the cache."""
    monkeypatch.setattr(gguf.GGUFWriter, 'add_ssm_group_count', lambda writer, count: None)
    src, _ = save_gguf('dense', tmp_path)
    with pytest.raises(ConfigError, match='ssm.group_count'):
        resolve_gguf(str(src))
    assert not (tmp_gguf_cache / 'gguf').exists() or not list((tmp_gguf_cache / 'gguf').iterdir())


def test_file_without_the_rotary_switch_rotates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp turns a ``granitehybrid`` file's queries and keys unless ``rope.scaling.finetuned`` is false: a file
    without the key is read as rotary (the converter writes it false for Granite 4.0-H, see the tests above)."""
    monkeypatch.setattr(gguf.GGUFWriter, 'add_rope_scaling_finetuned', lambda writer, value: None)
    src, _ = save_gguf('moe', tmp_path)
    assert json.loads((Path(resolve_gguf(str(src))) / 'config.json').read_text())['position_embedding_type'] == 'rope'
