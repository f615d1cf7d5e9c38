"""GLM-4 and SmolLM3 from GGUF: a tiny random transformers model written as llama.cpp's converter writes it
(gguf-py's tensor names, the converter's metadata, Llama-style q/k row order for SmolLM3), served by the
engine token for token like transformers on the original model."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import hf_greedy, make_engine, random_prompts, run
from test_gguf import CHAT_TEMPLATE, _add_tokenizer, finish, llama_permute
from test_model_families import save_family

from lmdeploy.pytorch.weights.gguf import convert_gguf

ARCHS = {'glm4': gguf.MODEL_ARCH.GLM4, 'smollm3': gguf.MODEL_ARCH.SMOLLM3}


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
        if config.model_type == 'smollm3' and name.endswith(('q_proj.weight', 'k_proj.weight')):
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
    assert run(make_engine(str(src)), prompts) == [hf_greedy(hf, p) for p in prompts]
