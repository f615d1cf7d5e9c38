"""Bamba from GGUF (llama.cpp's ``granitehybrid`` as convert_hf_to_gguf.py's ``GraniteHybridModel`` writes
``BambaForCausalLM``): a tiny random Bamba written with ``Mamba2Model``'s tensors, q/k rows permuted as Llama's over
the whole head, the rotary switch on (``rope.scaling.finetuned``) and ``rope.dimension_count`` half the head width
(the checkpoint's ``attn_rotary_emb``), no Granite multipliers. Read back, the folder is the Bamba checkpoint bit for
bit and the engine serves transformers' tokens; a Q8_0 file's projections are served as their blocks; other partial
rotaries, and partial rotary with Granite's experts or multipliers, are refused."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from test_gguf import _add_tokenizer, finish, llama_permute
from test_gguf_granitehybrid import add_mamba2_metadata, mamba2_tensor, write_gguf
from test_gguf_qwen3_next import layer_types
from transformers import AutoModelForCausalLM, BambaConfig

from conftest import save_random_model
from family_checks import assert_matches_transformers, hf_causal_lm
from helpers import assert_same_state, assert_transformers_greedy, make_engine, random_prompts, run

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def bamba_config(vocab: int) -> BambaConfig:
    """``test_bamba``'s shape: three layers, the second attention (four heads of 16 over two KV heads); eight Mamba
    heads of 16 in two B/C groups."""
    return BambaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                       attn_layer_indices=[1], intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
                       mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, vocab_size=vocab,
                       max_position_embeddings=1024, pad_token_id=None, architectures=['BambaForCausalLM'])


def converter_arrays(config, name: str, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """``GraniteHybridModel.modify_tensors`` on a Bamba checkpoint: ``Mamba2Model``'s tensors, q/k rows permuted as
    Llama's; by gguf-py's names (``feed_forward`` as ``ffn_*``, ``pre_ff_layernorm`` as ``ffn_norm``)."""
    name, data = mamba2_tensor(name, data, config.mamba_n_groups)
    if name.endswith(('q_proj.weight', 'k_proj.weight')):
        heads = config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads
        data = torch.from_numpy(llama_permute(data.numpy(), heads))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, config.num_hidden_layers)
    return {names.get_name(name, try_suffixes=('.weight', '.bias')): data}


def save_gguf(path: Path, quantize: bool = False, rope_dim: int = 8,
              extra_keys: dict[str, float] | None = None) -> tuple[Path, str]:
    """A tiny random Bamba saved in ``path / 'hf'`` (rewritten with the values the file holds) and written to
    ``path / 'model.gguf'`` with the converter's keys (``rope.dimension_count`` ``rope_dim``; ``extra_keys``: more
    ``GGUFWriter`` method: value), its projections as Q8_0 where ``quantize``."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), 'granitehybrid')
    vocab = _add_tokenizer(writer)
    folder = save_random_model(bamba_config(vocab), str(path / 'hf'))
    config = hf_causal_lm(folder).config
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_vocab_size, config.vocab_size), (writer.add_rope_dimension_count, rope_dim),
                       (writer.add_rope_scaling_finetuned, True),
                       *((getattr(writer, method), value) for method, value in (extra_keys or {}).items())]:
        add(value)
    add_mamba2_metadata(writer, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                        config.mamba_d_state, config.mamba_d_conv,
                        [config.num_key_value_heads if i in config.attn_layer_indices else 0
                         for i in range(config.num_hidden_layers)])
    write_gguf(writer, folder, quantize,
               lambda state: {k: v for name, t in state.items() for k, v in converter_arrays(config, name, t).items()})
    finish(writer)
    return src, folder



def test_f32_file_is_the_checkpoint_and_matches_transformers(tmp_path: Path) -> None:
    """Converted with every tensor dequantized, the folder is the Bamba checkpoint (its config's layers, shapes and
    half rotary; every tensor bit for bit, q/k rows put back, ``A_log`` as the file holds it); the engine's 32
    greedy tokens and first-step logits equal transformers'."""
    src, folder = save_gguf(tmp_path)
    hf = hf_causal_lm(folder)
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    for field in ('architectures', 'model_type', 'num_hidden_layers', 'attn_layer_indices', 'num_key_value_heads',
                  'intermediate_size', 'mamba_n_heads', 'mamba_d_head', 'mamba_n_groups', 'mamba_d_state',
                  'mamba_d_conv', 'mamba_expand', 'mamba_conv_bias', 'mamba_proj_bias', 'tie_word_embeddings'):
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    assert converted.config.rope_parameters['partial_rotary_factor'] == 0.5
    assert_same_state(converted, hf)
    vocab = hf.config.vocab_size
    assert_matches_transformers(str(src), hf, random_prompts([9, 70], seed=1, vocab=vocab),
                                random_prompts([5, 33], seed=2, vocab=vocab))


def test_q8_0_projections_stay_blocks_and_match_transformers(tmp_path: Path) -> None:
    """Every projection in Q8_0 (attention, Mamba-2 in and out, the MLP) is held as its blocks; the greedy tokens
    equal transformers' on the weights the blocks hold."""
    src, folder = save_gguf(tmp_path, quantize=True)
    hf = hf_causal_lm(folder)
    engine = make_engine(str(src))
    types = layer_types(engine.runner.model)
    assert set(types.values()) == {'Q8_0'}, types
    assert {name for name in types if name.startswith('layers.1.')} == {
        f'layers.1.{name}' for name in ('self_attn.qkv_proj', 'self_attn.o_proj', 'shared_mlp.gate_up_proj',
                                        'shared_mlp.down_proj')}
    prompts = random_prompts([6, 41], seed=3, vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


@pytest.mark.parametrize('rope_dim, extra_keys, message', [
    (4, None, 'turns 4 of its 16 head features'),
    (8, {'add_residual_scale': 0.22}, 'experts or Granite multipliers')])
def test_other_partial_rotaries_are_refused(rope_dim, extra_keys, message, tmp_path: Path) -> None:
    """A quarter rotary (transformers' Bamba turns half), or half with a Granite multiplier (not Bamba): refused,
    saying why."""
    src, _ = save_gguf(tmp_path, rope_dim=rope_dim, extra_keys=extra_keys)
    with pytest.raises(ConfigError, match=message):
        resolve_gguf(str(src))
