"""LFM2 and LFM2-MoE from GGUF (llama.cpp's ``lfm2``, ``lfm2moe``): tiny random transformers models written as
convert_hf_to_gguf.py's LFM2Model and LFM2MoeModel write them (the layer pattern as per-layer KV heads, 0 for a
convolution layer; the MLP width already adjusted; the convolution ``[C, K]``; the final norm as
``token_embd_norm``; the experts stacked per projection, the expert bias as ``exp_probs_b``), served by the engine
token for token like transformers; in F32, and LFM2-MoE in Q8_0 (attention, MLPs and experts kept as blocks, the
convolutions' projections dequantized). A file without its convolution's taps is refused, naming the key."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import MODEL_TENSOR as T

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, q8_0_blocks, random_prompts, run
from test_gguf import _add_tokenizer, finish
from test_lfm2 import STD, VARIANTS

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.models.lfm2 import dense_intermediate_size

# transformers' name in a layer -> the file's tensor
LAYER_TENSORS = {'operator_norm.weight': T.ATTN_NORM, 'ffn_norm.weight': T.FFN_NORM,
                 'conv.conv.weight': T.SHORTCONV_CONV, 'conv.in_proj.weight': T.SHORTCONV_INPROJ,
                 'conv.out_proj.weight': T.SHORTCONV_OUTPROJ, 'self_attn.q_proj.weight': T.ATTN_Q,
                 'self_attn.k_proj.weight': T.ATTN_K, 'self_attn.v_proj.weight': T.ATTN_V,
                 'self_attn.out_proj.weight': T.ATTN_OUT, 'self_attn.q_layernorm.weight': T.ATTN_Q_NORM,
                 'self_attn.k_layernorm.weight': T.ATTN_K_NORM, 'feed_forward.w1.weight': T.FFN_GATE,
                 'feed_forward.w3.weight': T.FFN_UP, 'feed_forward.w2.weight': T.FFN_DOWN,
                 'feed_forward.gate.weight': T.FFN_GATE_INP, 'feed_forward.experts.down_proj': T.FFN_DOWN_EXP}
GLOBAL_TENSORS = {'model.embed_tokens.weight': T.TOKEN_EMBD, 'model.embedding_norm.weight': T.TOKEN_EMBD_NORM,
                  'lm_head.weight': T.OUTPUT}
QUANTIZED = ('proj.weight', 'w1.weight', 'w2.weight', 'w3.weight', 'experts.gate_up_proj', 'experts.down_proj')


def write_metadata(config, writer: gguf.GGUFWriter, arch: str, l_cache: bool = True) -> None:
    """What LFM2Model and LFM2MoeModel (TextModels) write."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([config.num_key_value_heads if kind == 'full_attention' else 0
                              for kind in config.layer_types])
    writer.add_rope_freq_base(config.rope_parameters['rope_theta'])
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if l_cache:
        writer.add_shortconv_l_cache(config.conv_L_cache)
    if arch == 'lfm2':
        writer.add_feed_forward_length(dense_intermediate_size(config))
        return
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_leading_dense_block_count(config.num_dense_layers)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def file_tensors(hf: torch.nn.Module, quantize: bool) -> dict[str, np.ndarray]:
    """``hf``'s tensors under the file's names (with ``quantize`` the projections and experts in Q8_0, and
    ``hf``'s set to what those blocks hold)."""
    out = {}
    with torch.no_grad():
        for name, param in hf.state_dict().items():
            data = param.numpy()
            if quantize and name.endswith(QUANTIZED):
                data = q8_0_blocks(param)
            if not name.startswith('model.layers.'):
                out[gguf.TENSOR_NAMES[GLOBAL_TENSORS[name]] + '.weight'] = data
                continue
            layer, _, rest = name.removeprefix('model.layers.').partition('.')
            named = lambda tensor, kind='.weight': gguf.TENSOR_NAMES[tensor].format(bid=layer) + kind  # noqa: E731
            module, _, kind = rest.rpartition('.')
            if rest == 'conv.conv.weight':
                out[named(T.SHORTCONV_CONV)] = data.squeeze(1)
            elif kind == 'bias':  # the convolutions' (conv_bias)
                out[named(LAYER_TENSORS[f'{module}.weight'], '.bias')] = data
            elif rest == 'feed_forward.expert_bias':
                out[named(T.FFN_EXP_PROBS_B, '.bias')] = data
            elif rest == 'feed_forward.experts.gate_up_proj':
                gate, up = np.split(data, 2, axis=1)
                out[named(T.FFN_GATE_EXP)], out[named(T.FFN_UP_EXP)] = gate, up
            else:
                out[named(LAYER_TENSORS[rest])] = data
    return out


def write_gguf(tmp_path: Path, arch: str, quantize: bool = False, l_cache: bool = True):
    """A tiny random model of ``arch`` written as the converter writes it (without ``shortconv.l_cache`` where
    ``l_cache`` is off); returns the file and transformers' model of what it holds."""
    src = tmp_path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), arch)
    config = VARIANTS['lfm2' if arch == 'lfm2' else 'lfm2_moe']()
    config.vocab_size = _add_tokenizer(writer)
    if arch == 'lfm2moe':
        config.routed_scaling_factor = 1.0  # the converter does not write it: llama.cpp's routing leaves it out
    hf = hf_causal_lm(save_random_model(config, str(tmp_path / 'hf'), std=STD))
    write_metadata(hf.config, writer, arch, l_cache)
    for name, data in file_tensors(hf, quantize).items():
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    finish(writer)
    return src, hf


@pytest.mark.parametrize('arch, quantize', [('lfm2', False), ('lfm2moe', False), ('lfm2moe', True)],
                         ids=['lfm2-f32', 'lfm2moe-f32', 'lfm2moe-q8_0'])
def test_gguf_lfm2_matches_transformers(arch: str, quantize: bool, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, hf = write_gguf(tmp_path, arch, quantize)
    engine = make_engine(str(src))
    if quantize:  # kept as the file's blocks; the convolutions' projections dequantized
        layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
        assert layer_types['layers.2.self_attn.qkv_proj'] == 'Q8_0'
        assert layer_types['layers.0.mlp.gate_up_proj'] == 'Q8_0'
        assert layer_types['layers.1.mlp.experts.gate_up_proj'] == 'Q8_0'
    prompts = random_prompts([1, 5, 23, 41], vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


def test_gguf_lfm2_without_convolution_taps_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, _ = write_gguf(tmp_path, 'lfm2', l_cache=False)
    with pytest.raises(ConfigError, match='missing GGUF metadata: shortconv.l_cache'):
        make_engine(str(src))
