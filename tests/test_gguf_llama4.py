"""Llama 4 from GGUF (llama.cpp's ``llama4``): a tiny random ``Llama4ForCausalLM`` (MoE and dense layers interleaved,
rope layers attending in chunks, a NoPE layer with its query temperature, Scout's llama3 rotary that steps at one
wavelength) written as convert_hf_to_gguf.py's Llama4Model writes it (experts' ``gate_up_proj`` split and
transposed, q/k rows left as they are, the rotary as ``rope_freqs``), in F32, F16 and Q8_0, served by the engine
token for token like transformers on the weights the file holds. llama.cpp fixes the chunk (8192 positions) and the
temperature's floor (8192): the long prompt crosses both."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, Llama4TextConfig

from conftest import save_random_model
from family_checks import assert_first_logits_close, hf_causal_lm
from helpers import assert_same_state, assert_transformers_greedy, make_engine, random_prompts, reference_logits, run
from test_gguf import _byte_tokens, finish

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.models.llama4 import Llama4MoE
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf
from lmdeploy.tokenizer import Tokenizer

LONG = 8250  # past llama.cpp's fixed chunk and temperature floor (8192)
SPECIALS = ['<|begin_of_text|>', '<|end_of_text|>', '<|header_start|>', '<|header_end|>', '<|eot|>']
MERGES = ['l l', 'o W', '3 4']  # 'o W' and '3 4' would merge across Llama 4's pre-tokenizer splits
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
                 "{{ m['content'] }}<|eot|>{% endfor %}"
                 "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}")
# Scout's rotary: llama3 scaling whose low and high factors are both 1 (a step at the original context)
ROPE = {'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 16.0, 'low_freq_factor': 1.0, 'high_freq_factor': 1.0,
        'original_max_position_embeddings': 64}
# hidden 64 and widths of whole Q8_0 blocks (32 inputs); llama.cpp's fixed chunk, NoPE step and temperature
CONFIG = dict(hidden_size=64, intermediate_size=96, intermediate_size_mlp=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
              interleave_moe_layer_step=2, max_position_embeddings=16384, tie_word_embeddings=False,
              rope_parameters=ROPE)

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def add_tokenizer(writer: gguf.GGUFWriter, specials: list[str] = SPECIALS, chat_template: str = CHAT_TEMPLATE) -> int:
    """A byte-level vocabulary as the converter's ``_set_vocab_gpt2`` writes Llama 4's (pre-tokenizer ``llama4``),
    with Llama 4's special tokens (``specials``) and a chat template (by default of its form); the vocabulary's
    size."""
    tokens = _byte_tokens() + [m.replace(' ', '') for m in MERGES] + specials
    writer.add_tokenizer_model('gpt2')
    writer.add_tokenizer_pre('llama4')
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(specials)) + [3] * len(specials))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index('<|begin_of_text|>'))
    writer.add_eos_token_id(tokens.index('<|eot|>'))
    writer.add_chat_template(chat_template)
    return len(tokens)


def write_metadata(config: Llama4TextConfig, writer: gguf.GGUFWriter) -> None:
    """What Llama4Model writes: TextModel's keys with the dense MLP's width as ``feed_forward_length``, LlamaModel's
    vocabulary size and rotary width, its own MoE step and expert width, a sliding window of 0 where no layer is
    chunked; the llama3 rotary as ``rope_freqs`` only."""
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size_mlp),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_expert_count, config.num_local_experts),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_vocab_size, config.vocab_size),
                       (writer.add_rope_dimension_count, config.head_dim),
                       (writer.add_interleave_moe_layer_step, config.interleave_moe_layer_step),
                       (writer.add_expert_feed_forward_length, config.intermediate_size)]:
        add(value)
    if all(kind == 'full_attention' for kind in config.layer_types):  # MobileLLM-R1: no chunks, no NoPE layer
        writer.add_sliding_window(0)


def rope_freqs(config: Llama4TextConfig) -> np.ndarray:
    """LlamaModel.generate_extra_tensors' llama3 divisors (a step here: low and high factor are equal)."""
    rope, dim = config.rope_parameters, config.head_dim
    wavelengths = 2 * np.pi * rope['rope_theta'] ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    context = rope['original_max_position_embeddings']
    return np.where(wavelengths > context / rope['low_freq_factor'], rope['factor'], 1.0).astype(np.float32)


def converter_tensors(hf: torch.nn.Module) -> dict[str, np.ndarray]:
    """``hf``'s tensors as Llama4Model.modify_tensors hands them to gguf-py: each MoE layer's ``gate_up_proj [E, H,
    2I]`` transposed and split into gate and up ``[E, I, H]``, ``down_proj [E, I, H]`` transposed."""
    out = {}
    for name, param in hf.state_dict().items():
        data = param.detach().numpy()
        if name.endswith('experts.gate_up_proj'):
            gate, up = np.split(data.swapaxes(-1, -2), 2, axis=-2)
            out[name.replace('gate_up_proj', 'gate_proj.weight')] = gate
            out[name.replace('gate_up_proj', 'up_proj.weight')] = up
        elif name.endswith('experts.down_proj'):
            out[f'{name}.weight'] = data.swapaxes(-1, -2)
        else:
            out[name] = data
    return out


def stored(data: np.ndarray, gguf_name: str, qtype: Q) -> tuple[np.ndarray, Q]:
    """The array the converter writes for ``gguf_name`` with ``--outtype`` ``qtype``: norms, other 1-D tensors and
    the router in F32, every other matrix in ``qtype``."""
    if data.ndim <= 1 or gguf_name.endswith(('_norm.weight', 'ffn_gate_inp.weight')) or qtype == Q.F32:
        return np.ascontiguousarray(data, dtype=np.float32), Q.F32
    if qtype == Q.F16:
        return data.astype(np.float16), Q.F16
    return gguf.quants.quantize(np.ascontiguousarray(data), qtype), qtype


def random_llama4(path: Path, qtype: Q = Q.F32, down_experts: Q | None = None, **overrides) -> torch.nn.Module:
    """A tiny random Llama 4 (``CONFIG`` with ``overrides``) written to ``path / 'model.gguf'`` as the converter
    writes it with ``--outtype`` ``qtype`` (the experts' down projections in ``down_experts`` where given, as mixed
    quantizations write them); transformers' model of the weights the file holds."""
    writer = gguf.GGUFWriter(str(path / 'model.gguf'), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA4])
    config = Llama4TextConfig(**CONFIG | overrides, vocab_size=add_tokenizer(writer))
    config.architectures = ['Llama4ForCausalLM']
    hf = hf_causal_lm(save_random_model(config, str(path / 'hf')))
    write_language_model(hf, writer, qtype, down_experts)
    return hf


def write_language_model(hf: torch.nn.Module, writer: gguf.GGUFWriter, qtype: Q = Q.F32,
                         down_experts: Q | None = None) -> None:
    """transformers' ``Llama4ForCausalLM`` ``hf`` into ``writer`` (its vocabulary written already) as Llama4Model
    writes it with ``--outtype`` ``qtype`` (see :func:`random_llama4`), and the file finished; ``hf`` takes the
    weights the file holds."""
    write_metadata(hf.config, writer)
    if hf.config.rope_parameters['rope_type'] == 'llama3':
        writer.add_tensor('rope_freqs.weight', rope_freqs(hf.config))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, hf.config.num_hidden_layers)
    held = {}
    for name, data in converter_tensors(hf).items():
        gguf_name = names.get_name(name, try_suffixes=('.weight', '.bias'))
        down = down_experts is not None and gguf_name.endswith('ffn_down_exps.weight')
        array, array_type = stored(data, gguf_name, down_experts if down else qtype)
        writer.add_tensor(gguf_name, array, raw_dtype=array_type if array.dtype == np.uint8 else None)
        held[name] = torch.from_numpy(gguf.quants.dequantize(array, array_type).astype(np.float32).reshape(data.shape))
    finish(writer)
    with torch.no_grad():  # transformers' model of what the file holds
        for name, param in hf.state_dict().items():
            if name.endswith('experts.gate_up_proj'):
                gate, up = held[name.replace('gate_up_proj', 'gate_proj.weight')], held[
                    name.replace('gate_up_proj', 'up_proj.weight')]
                param.copy_(torch.cat((gate, up), 1).transpose(1, 2))
            elif name.endswith('experts.down_proj'):
                param.copy_(held[f'{name}.weight'].transpose(1, 2))
            else:
                param.copy_(held[name])



def long_engine(src: Path, **kwargs):
    """An engine with room for the long prompt (its 8250 tokens and 32 more)."""
    return make_engine(str(src), block_size=64, num_gpu_blocks=160, **kwargs)


def test_f32_file_is_the_original_checkpoint_and_matches_transformers(tmp_path: Path) -> None:
    """Converted with every tensor dequantized, the folder is transformers' own checkpoint (config and weights,
    bit for bit); the engine's greedy tokens equal transformers' on a short and a long prompt (prefilled in chunks
    of 4096 tokens), as do its first-step logits (both prompts whole in one step)."""
    hf = random_llama4(tmp_path)
    src = tmp_path / 'model.gguf'
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    for field in ('architectures', 'model_type', 'intermediate_size', 'intermediate_size_mlp', 'num_local_experts',
                  'num_experts_per_tok', 'moe_layers', 'no_rope_layers', 'layer_types', 'attention_chunk_size',
                  'use_qk_norm', 'attn_temperature_tuning', 'floor_scale', 'attn_scale', 'head_dim',
                  'rope_parameters', 'tie_word_embeddings'):
        assert getattr(converted.config, field) == getattr(hf.config, field), field
    assert converted.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)  # a float32 in the file
    assert converted.config.layer_types == ['chunked_attention'] * 3 + ['full_attention']
    assert converted.config.moe_layers == [1, 3]
    assert_same_state(converted, hf)

    engine = long_engine(src)
    layers = engine.runner.model.layers
    assert [layer.self_attn.attn.attention_chunk for layer in layers] == [8192, 8192, 8192, None]
    assert [isinstance(layer.mlp, Llama4MoE) for layer in layers] == [False, True, False, True]
    prompts = random_prompts([7, LONG], seed=1, vocab=hf.config.vocab_size)
    outs = run(engine, prompts)
    # one transformers forward a prompt for both checks: the greedy tokens (as assert_transformers_greedy) and
    # the first step's logits (row 0; the 8250-token forward is the costly part)
    refs = [reference_logits(hf, prompt, tokens) for prompt, tokens in zip(prompts, outs)]
    assert [len(tokens) for tokens in outs] == [32, 32] and [ref.argmax(-1).tolist() for ref in refs] == outs
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    one_step = long_engine(src, max_prefill_token_num=LONG + 64)  # both prompts whole in the first step
    assert_first_logits_close(one_step, prompts, [ref[0] for ref in refs])


def kept_layers(config: Llama4TextConfig) -> list[str]:
    """The engine's linear layers a Q8_0 file keeps as blocks: every projection, shared expert and expert."""
    names = []
    for layer in range(config.num_hidden_layers):
        mlps = ['mlp.shared_expert', 'mlp.experts'] if layer in config.moe_layers else ['mlp']
        names += [f'layers.{layer}.self_attn.{proj}' for proj in ('qkv_proj', 'o_proj')]
        names += [f'layers.{layer}.{mlp}.{proj}' for mlp in mlps for proj in ('gate_up_proj', 'down_proj')]
    return names


@pytest.mark.parametrize('qtype,down_experts', [(Q.F16, None), (Q.Q8_0, None), (Q.Q8_0, Q.F16)],
                         ids=['F16', 'Q8_0', 'Q8_0-F16-down-experts'])
def test_f16_and_q8_0_files_match_transformers(tmp_path: Path, qtype: Q, down_experts: Q | None) -> None:
    """An F16 file is dequantized at conversion, its experts back in Meta's stacked layout; a Q8_0 file keeps
    attention, the dense MLPs, the shared experts and the routed experts (one tensor per expert) as their blocks,
    the router dense; with F16 experts' down projections, those alone go back stacked and dense. Each answers as
    transformers does on the weights the file holds."""
    hf = random_llama4(tmp_path, qtype, down_experts)
    src = str(tmp_path / 'model.gguf')
    engine = make_engine(src)
    index = json.loads((Path(resolve_gguf(src)) / 'model.safetensors.index.json').read_text())
    experts = sorted(name for name in index['weight_map'] if name.startswith('model.layers.1.feed_forward.experts.'))
    prefix = 'model.layers.1.feed_forward.experts'
    if qtype == Q.F16:
        assert not hasattr(engine.model_config.hf_config, 'quantization_config')
        assert experts == [f'{prefix}.down_proj', f'{prefix}.gate_up_proj']
    else:
        kept = [proj for proj in ('gate', 'up', 'down') if proj != 'down' or down_experts is None]
        layers = [name for name in kept_layers(hf.config) if down_experts is None or 'experts.down' not in name]
        assert engine.model_config.hf_config.quantization_config['ggml_types'] == dict.fromkeys(layers, 'Q8_0')
        assert experts == sorted([f'{prefix}.{expert}.{proj}_proj.qweight' for expert in range(4) for proj in kept] +
                                 ([f'{prefix}.down_proj'] if down_experts else []))
    prompts = random_prompts([5, 41], seed=2, vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


def test_chat_template_and_tokenizer_come_from_the_file(tmp_path: Path) -> None:
    """The file's chat template renders the conversation; text splits as Llama 4's pre-tokenizer splits it (a
    GPT-2 split would merge ``oW`` and ``34``); a reply ends at ``<|eot|>``."""
    hf = random_llama4(tmp_path)
    tokenizer = Tokenizer(resolve_gguf(str(tmp_path / 'model.gguf')))
    assert tokenizer.hf.chat_template == CHAT_TEMPLATE
    messages = [{'role': 'user', 'content': 'HelloWorld 12345'}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == ('<|begin_of_text|><|header_start|>user<|header_end|>\n\nHelloWorld 12345<|eot|>'
                      '<|header_start|>assistant<|header_end|>\n\n')
    assert tokenizer.hf.tokenize('HelloWorld 12345') == ['H', 'e', 'll', 'o', 'W', 'o', 'r', 'l', 'd', 'Ġ', '1',
                                                          '2', '3', '4', '5']
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    vocab = hf.config.vocab_size
    assert ids[0] == vocab - len(SPECIALS) + SPECIALS.index('<|begin_of_text|>')
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert tokenizer.eos_token_ids == {vocab - len(SPECIALS) + SPECIALS.index('<|eot|>')}


PLAIN_ROPE = {'rope_type': 'default', 'rope_theta': 500000.0}


@pytest.mark.parametrize('variant,overrides', [
    ('maverick', dict(num_local_experts=128, use_qk_norm=False, rope_parameters=PLAIN_ROPE)),
    ('mobilellm', dict(num_local_experts=0, moe_layers=[], no_rope_layers=[1, 1, 1, 1], attention_chunk_size=None,
                       rope_parameters=PLAIN_ROPE))], ids=['maverick', 'mobilellm'])
def test_variants_llama_cpp_tells_apart(tmp_path: Path, variant: str, overrides: dict) -> None:
    """What llama.cpp infers from the file: 128 experts are Maverick's, without the q/k norm; a sliding window of 0
    is MobileLLM-R1's dense model, every layer rotating over all positions. Neither has llama3 scaling."""
    hf = random_llama4(tmp_path, **overrides)
    engine = make_engine(str(tmp_path / 'model.gguf'))
    config = engine.model_config.hf_config
    for field in ('use_qk_norm', 'moe_layers', 'no_rope_layers', 'layer_types', 'attention_chunk_size',
                  'rope_parameters'):
        assert getattr(config, field) == getattr(hf.config, field), field
    assert config.use_qk_norm == (variant != 'maverick')
    assert config.layer_types == (['full_attention'] * 4 if variant == 'mobilellm' else
                                  ['chunked_attention'] * 3 + ['full_attention'])
    prompts = random_prompts([6, 37], seed=3, vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


def test_file_without_its_moe_step_is_refused(tmp_path: Path, tmp_gguf_cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp requires ``llama4.interleave_moe_layer_step``; a file without it is refused, naming the key, and
    leaves nothing in the cache."""
    monkeypatch.setattr(gguf.GGUFWriter, 'add_interleave_moe_layer_step', lambda writer, step: None)
    random_llama4(tmp_path)
    with pytest.raises(ConfigError, match='llama4.interleave_moe_layer_step'):
        resolve_gguf(str(tmp_path / 'model.gguf'))
    assert not (tmp_gguf_cache / 'gguf').exists() or not list((tmp_gguf_cache / 'gguf').iterdir())
