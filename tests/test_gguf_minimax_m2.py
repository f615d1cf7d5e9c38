"""MiniMax-M2 from GGUF (llama.cpp's ``minimax-m2``): a tiny random transformers model written as
convert_hf_to_gguf.py's MiniMaxM2Model writes it (q/k rows as they are, the q/k norms over all heads, the experts
stacked per projection, the router's correction bias as ``exp_probs_b``, ``rotary_dim`` as the rope's dimension
count), served by the engine token for token like transformers; in F32, and with the projections and experts in
Q8_0 kept as their blocks."""
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
from test_minimax_m2 import minimax_m2_config

# transformers' name in a layer -> the file's tensor
LAYER_TENSORS = {'input_layernorm.weight': T.ATTN_NORM, 'self_attn.q_proj.weight': T.ATTN_Q,
                 'self_attn.k_proj.weight': T.ATTN_K, 'self_attn.v_proj.weight': T.ATTN_V,
                 'self_attn.o_proj.weight': T.ATTN_OUT, 'self_attn.q_norm.weight': T.ATTN_Q_NORM,
                 'self_attn.k_norm.weight': T.ATTN_K_NORM, 'post_attention_layernorm.weight': T.FFN_NORM,
                 'mlp.gate.weight': T.FFN_GATE_INP, 'mlp.experts.down_proj': T.FFN_DOWN_EXP}
QUANTIZED = ('proj.weight', 'experts.gate_up_proj', 'experts.down_proj')


def write_metadata(config, writer: gguf.GGUFWriter) -> None:
    """What MiniMaxM2Model (a TextModel) writes."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters['rope_theta'])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(config.rotary_dim)


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
                tensor = {'model.embed_tokens.weight': T.TOKEN_EMBD, 'model.norm.weight': T.OUTPUT_NORM,
                          'lm_head.weight': T.OUTPUT}[name]
                out[gguf.TENSOR_NAMES[tensor] + '.weight'] = data
                continue
            layer, _, rest = name.removeprefix('model.layers.').partition('.')
            named = lambda tensor, kind='.weight': gguf.TENSOR_NAMES[tensor].format(bid=layer) + kind  # noqa: E731
            if rest == 'mlp.e_score_correction_bias':
                out[named(T.FFN_EXP_PROBS_B, '.bias')] = data
            elif rest == 'mlp.experts.gate_up_proj':
                gate, up = np.split(data, 2, axis=1)
                out[named(T.FFN_GATE_EXP)], out[named(T.FFN_UP_EXP)] = gate, up
            else:
                out[named(LAYER_TENSORS[rest])] = data
    return out


@pytest.mark.parametrize('quantize', [False, True], ids=['f32', 'q8_0'])
def test_gguf_minimax_m2_matches_transformers(quantize: bool, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), 'minimax-m2')
    config = minimax_m2_config(hidden_size=64, head_dim=32, rotary_dim=16, intermediate_size=64)  # Q8_0: 32 a block
    config.vocab_size = _add_tokenizer(writer)
    hf = hf_causal_lm(save_random_model(config, str(tmp_path / 'hf'), std={'e_score_correction_bias': 0.3}))
    write_metadata(hf.config, writer)
    for name, data in file_tensors(hf, quantize).items():
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    finish(writer)

    engine = make_engine(str(src))
    if quantize:  # kept as the file's blocks
        layer_types = engine.model_config.hf_config.quantization_config['ggml_types']
        for layer in range(config.num_hidden_layers):
            for name in ('self_attn.qkv_proj', 'self_attn.o_proj', 'mlp.experts.gate_up_proj'):
                assert layer_types[f'layers.{layer}.{name}'] == 'Q8_0', (layer, name)
    prompts = random_prompts([5, 23, 41], vocab=config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
