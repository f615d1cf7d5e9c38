"""OLMoE, Granite 3 MoE and StarCoder2 from GGUF (llama.cpp's ``olmoe``, ``granitemoe``, ``starcoder2``): a tiny
random transformers model written as convert_hf_to_gguf.py writes it (OLMoE's experts stacked per projection, its q/k
norms over all heads, q/k rows as they are; Granite 3 MoE's q/k rows permuted as Llama's, its multipliers as scales,
each fused ``input_linear`` split into stacked gate and up experts, a shared MLP's into ``ffn_{gate,up}_shexp``;
StarCoder2's biased LayerNorms and projections, ``c_fc``/``c_proj`` as ``ffn_up``/``ffn_down``), read back into the
original tensors and served token for token like transformers on the original model; with the projections and experts in Q8_0, served as their blocks."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import MODEL_TENSOR as T
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf import _add_tokenizer, finish, llama_permute
from test_gguf_llama_like import converted_model
from test_granitemoe import granitemoe_config
from test_olmoe import olmoe_config
from test_starcoder2 import starcoder2_config


ARCHS = {'olmoe': gguf.MODEL_ARCH.OLMOE, 'granitemoe': gguf.MODEL_ARCH.GRANITE_MOE,
         'starcoder2': gguf.MODEL_ARCH.STARCODER2}
CONFIGS = {'olmoe': olmoe_config, 'granitemoe': granitemoe_config,
           'starcoder2': lambda **overrides: starcoder2_config(sliding_window=None, **overrides)}
# Granite 3 MoE and GraniteMoeShared (test_gguf_granitemoeshared.py), both ``granitemoe`` files
GRANITE_MOE_TYPES = ('granitemoe', 'granitemoeshared')
# the projections and experts that the Q8_0 files hold as blocks
QUANTIZED = ('proj.weight', 'c_fc.weight', 'c_proj.weight', 'input_linear.weight', 'output_linear.weight')


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The keys the converter writes for ``config``'s family: TextModel's (OLMoE's fixed RMS epsilon, StarCoder2's
    LayerNorm epsilon), plus LlamaModel's and Granite's scales for Granite 3 MoE, and the experts' counts."""
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta'])]:
        add(value)
    if config.model_type == 'starcoder2':
        writer.add_layer_norm_eps(config.norm_epsilon)
        return
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type in GRANITE_MOE_TYPES:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if getattr(config, 'shared_intermediate_size', 0):
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)


def file_tensors(folder: str, config, quantize: bool) -> dict[str, np.ndarray]:
    """The saved checkpoint's tensors under the file's names, as the converter writes them; with ``quantize`` the
    projections and experts as Q8_0 blocks, and the checkpoint in ``folder`` rewritten with what those blocks hold."""
    state = load_file(str(Path(folder) / 'model.safetensors'))
    arch = ARCHS['granitemoe' if config.model_type in GRANITE_MOE_TYPES else config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    stacked: dict[str, list[np.ndarray]] = {}
    out = {}
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if quantize and name.endswith(QUANTIZED):  # row by row: the same blocks before or after a permutation
            data = gguf.quants.quantize(data, Q.Q8_0)
            state[name] = torch.from_numpy(gguf.quants.dequantize(data, Q.Q8_0))
        if config.model_type in GRANITE_MOE_TYPES and name.endswith(('q_proj.weight', 'k_proj.weight')):
            data = llama_permute(data, config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads)
        layer = name.removeprefix('model.layers.').partition('.')[0]
        if '.mlp.experts.' in name:  # OLMoE's experts, one tensor each: stacked per projection
            prefix, _, rest = name.partition('.experts.')
            stacked.setdefault(f'{prefix}.experts.{rest.partition(".")[2]}', []).append(data)
        elif name.endswith('input_linear.weight'):  # Granite's fused gate and up (experts, shared MLP): split
            shared = 'shared_mlp' in name
            gate, up = np.split(data, 2, axis=0 if shared else 1)
            for part, values in ((T.FFN_GATE_SHEXP if shared else T.FFN_GATE_EXP, gate),
                                 (T.FFN_UP_SHEXP if shared else T.FFN_UP_EXP, up)):
                out[gguf.TENSOR_NAMES[part].format(bid=layer) + '.weight'] = values
        else:
            out[names.get_name(name, try_suffixes=('.weight', '.bias'))] = data
    for name, experts in stacked.items():  # in expert order: the checkpoint lists them sorted, 0 to 3
        out[names.get_name(name, try_suffixes=('.weight',))] = np.stack(experts)
    if quantize:
        save_file(state, str(Path(folder) / 'model.safetensors'), metadata={'format': 'pt'})
    return out


def save_gguf(kind: str, path: Path, quantize: bool, make_config=None) -> tuple[Path, str, int]:
    """A tiny random ``kind`` (of ``make_config``'s config where given) saved in ``path / 'hf'`` and written to
    ``path / 'model.gguf'``: the file, the folder and the vocabulary size."""
    src = path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[ARCHS[kind]])
    vocab = _add_tokenizer(writer)
    folder = save_random_model((make_config or CONFIGS[kind])(vocab_size=vocab), str(path / 'hf'))
    config = AutoConfig.from_pretrained(folder)
    add_metadata(writer, config)
    for name, data in file_tensors(folder, config, quantize).items():
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    finish(writer)
    return src, folder, vocab


@pytest.mark.parametrize('kind', sorted(ARCHS))
def test_gguf_matches_transformers(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path, quantize=False)
    hf = hf_causal_lm(folder)
    converted_model(src, tmp_path, hf)
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


@pytest.mark.parametrize('kind', sorted(ARCHS))
def test_gguf_q8_0_kept_as_blocks(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's projections and the experts (or StarCoder2's down projection; its ungated up projection is
    dequantized) in Q8_0 are served as their blocks, token for token like transformers on the weights they hold."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, folder, vocab = save_gguf(kind, tmp_path, quantize=True)
    hf = hf_causal_lm(folder)
    engine = make_engine(str(src))
    layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
    served = ('self_attn.qkv_proj', 'self_attn.o_proj') + (
        ('mlp.down_proj',) if kind == 'starcoder2' else ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj'))
    for layer in range(hf.config.num_hidden_layers):
        for name in served:
            assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))

