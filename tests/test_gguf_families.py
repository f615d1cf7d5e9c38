"""GLM-4, SmolLM3 and Llama 3.1-style rotary scaling from GGUF: a tiny random transformers model written as llama.cpp's converter writes it
(gguf-py's tensor names, the converter's metadata, Llama-style q/k row order for SmolLM3), served by the
engine token for token like transformers on the original model."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import save_random_model
from helpers import assert_transformers_greedy, hf_greedy, make_engine, random_prompts, run
from test_gguf import CHAT_TEMPLATE, _add_tokenizer, finish, llama_permute
from test_model_families import save_family

from lmdeploy.pytorch.weights.gguf import convert_gguf
from lmdeploy.pytorch.weights.gguf_rope import llama3_rope

ARCHS = {'glm4': gguf.MODEL_ARCH.GLM4, 'smollm3': gguf.MODEL_ARCH.SMOLLM3, 'llama': gguf.MODEL_ARCH.LLAMA}


def write_gguf(model: torch.nn.Module, path: Path, writer: gguf.GGUFWriter) -> None:
    """``model``'s config and fp32 tensors as convert_hf_to_gguf.py writes them for its architecture."""
    config = model.config
    head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps)]:
        add(value)
    if config.model_type == 'glm4':  # Glm4Model: key/value length from head_dim, rotary over a share of it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get('partial_rotary_factor', 0.5)))
    else:  # LlamaModel: the whole head rotates, q/k rows reordered for llama.cpp's rotary
        writer.add_rope_dimension_count(head_dim)
    names = gguf.get_tensor_name_map(ARCHS[config.model_type], config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == 'lm_head.weight' and config.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if config.model_type in ('smollm3', 'llama') and name.endswith(('q_proj.weight', 'k_proj.weight')):
            heads = config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads
            data = llama_permute(data, heads)
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), np.ascontiguousarray(data))
    finish(writer)


@pytest.mark.parametrize('kind,tied', [('glm4', False), ('smollm3', True)])
def test_gguf_family_matches_transformers(kind: str, tied: bool, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / f'{kind}.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[ARCHS[kind]])
    vocab = _add_tokenizer(writer)
    writer.add_eot_token_id(vocab - 3)  # a second end token, as GLM-4's files name <|user|>
    folder = save_family(kind, str(tmp_path / 'hf'), vocab_size=vocab, tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    write_gguf(hf, src, writer)

    convert_gguf(str(src), str(tmp_path / 'converted'))
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    assert converted.config.architectures == hf.config.architectures
    assert converted.config.eos_token_id == [vocab - 1, vocab - 3]
    if kind == 'smollm3':
        assert converted.config.no_rope_layers == hf.config.no_rope_layers == [1, 1, 1, 0]
    else:
        assert converted.config.rope_parameters['partial_rotary_factor'] == 0.5
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / 'converted'))
    assert tokenizer.chat_template == CHAT_TEMPLATE and tokenizer.eos_token == '<|im_end|>'
    state = hf.state_dict()
    for name, value in converted.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)

    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


LLAMA3_ROPE = {'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0, 'low_freq_factor': 1.0,
               'high_freq_factor': 4.0, 'original_max_position_embeddings': 64}


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 3.1+ files carry their rotary scaling only as llama.cpp's ``rope_freqs`` divisors (no metadata):
    the converted config gets the ``llama3`` parameters back, and the engine answers as transformers does on
    the original, past the 64-token original context too. Without the divisors the tokens differ."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, rope_parameters=dict(LLAMA3_ROPE))
    src = tmp_path / 'llama3.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    vocab = _add_tokenizer(writer)
    config.vocab_size = vocab
    hf = AutoModelForCausalLM.from_pretrained(save_random_model(config, str(tmp_path / 'hf')),
                                              dtype=torch.float32).eval()
    head_dim = config.hidden_size // config.num_attention_heads
    default = 1 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaled, _ = ROPE_INIT_FUNCTIONS['llama3'](hf.config, torch.device('cpu'))
    divisors = (default / scaled).numpy().astype(np.float32)
    assert divisors.min() == 1.0 and divisors.max() == 8.0 and ((divisors > 1) & (divisors < 8)).any()
    writer.add_tensor('rope_freqs.weight', divisors)
    write_gguf(hf, src, writer)

    convert_gguf(str(src), str(tmp_path / 'converted'))
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    assert converted.config.rope_parameters == LLAMA3_ROPE
    prompts = random_prompts([5, 40, 120], vocab=vocab)
    expected = [hf_greedy(hf, p) for p in prompts]
    assert run(make_engine(str(src), session_len=256), prompts) == expected
    hf.model.rotary_emb.inv_freq.copy_(default)
    assert hf_greedy(hf, prompts[-1]) != expected[-1]


@pytest.mark.parametrize('theta,head_dim,params', [
    (500000.0, 128, {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                     'original_max_position_embeddings': 8192}),  # Llama 3.1 8B
    (500000.0, 64, {'factor': 32.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                    'original_max_position_embeddings': 8192}),  # Llama 3.2 1B
    (500000.0, 128, {'factor': 8.0, 'low_freq_factor': 2.0, 'high_freq_factor': 6.0,
                     'original_max_position_embeddings': 8192})])
def test_llama3_parameters_from_the_divisors(theta: float, head_dim: int, params: dict) -> None:
    rope = {'rope_type': 'llama3', 'rope_theta': theta, **params}
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, max_position_embeddings=131072,
                         rope_parameters=dict(rope))
    scaled, _ = ROPE_INIT_FUNCTIONS['llama3'](config, torch.device('cpu'))
    default = 1 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert llama3_rope((default / scaled).numpy(), theta, head_dim, 'f.gguf') == rope


def test_divisors_that_are_not_llama3_are_refused() -> None:
    with pytest.raises(ValueError, match='f.gguf: the rope_freqs.weight factors are not Llama 3 rotary scaling'):
        llama3_rope(np.array([1.0, 3.0, 2.0, 8.0]), 10000.0, 8, 'f.gguf')
