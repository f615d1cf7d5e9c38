"""Jamba from GGUF (llama.cpp's ``jamba``): a tiny random ``JambaForCausalLM`` (Mamba-1, attention and MoE layers)
written as convert_hf_to_gguf.py's ``JambaModel`` writes it (the attention layers as a per-layer ``head_count_kv``, 0
for a Mamba layer; ``A`` as ``-exp(A_log)``, the convolution squeezed; the dt/B/C norms as ``ssm_*_norm``; the
experts stacked), served by the engine token for token like transformers; a file whose attention layers are not
periodic is refused."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import MODEL_TENSOR as T

from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf import _add_tokenizer, finish
from test_jamba import jamba_config

from lmdeploy.messages import ConfigError

# transformers' module in a layer -> the file's tensor
LAYER_TENSORS = {'input_layernorm': T.ATTN_NORM, 'pre_ff_layernorm': T.FFN_NORM, 'self_attn.q_proj': T.ATTN_Q,
                 'self_attn.k_proj': T.ATTN_K, 'self_attn.v_proj': T.ATTN_V, 'self_attn.o_proj': T.ATTN_OUT,
                 'mamba.in_proj': T.SSM_IN, 'mamba.conv1d': T.SSM_CONV1D, 'mamba.x_proj': T.SSM_X,
                 'mamba.dt_proj': T.SSM_DT, 'mamba.dt_layernorm': T.SSM_DT_NORM, 'mamba.b_layernorm': T.SSM_B_NORM,
                 'mamba.c_layernorm': T.SSM_C_NORM, 'mamba.out_proj': T.SSM_OUT, 'mamba.A_log': T.SSM_A,
                 'mamba.D': T.SSM_D, 'feed_forward.gate_proj': T.FFN_GATE, 'feed_forward.up_proj': T.FFN_UP,
                 'feed_forward.down_proj': T.FFN_DOWN, 'feed_forward.router': T.FFN_GATE_INP}
GLOBAL_TENSORS = {'model.embed_tokens.weight': T.TOKEN_EMBD, 'model.final_layernorm.weight': T.OUTPUT_NORM,
                  'lm_head.weight': T.OUTPUT}


def file_tensors(hf: torch.nn.Module) -> dict[str, np.ndarray]:
    """``hf``'s tensors under the file's names, as ``JambaModel.modify_tensors`` gives them."""
    out = {}
    for name, param in hf.state_dict().items():
        data = param.detach().numpy()
        if name in GLOBAL_TENSORS:
            out[gguf.TENSOR_NAMES[GLOBAL_TENSORS[name]] + '.weight'] = data
            continue
        layer, _, rest = name.removeprefix('model.layers.').partition('.')
        named = lambda tensor, kind='.weight': gguf.TENSOR_NAMES[tensor].format(bid=layer) + kind  # noqa: E731
        if rest == 'feed_forward.experts.gate_up_proj':  # [E, 2I, H]: the experts' gate rows, then up
            out[named(T.FFN_GATE_EXP)], out[named(T.FFN_UP_EXP)] = np.split(data, 2, axis=1)
        elif rest == 'feed_forward.experts.down_proj':
            out[named(T.FFN_DOWN_EXP)] = data
        elif rest in ('mamba.A_log', 'mamba.D'):
            out[named(LAYER_TENSORS[rest], '')] = -np.exp(data) if rest == 'mamba.A_log' else data
        else:
            module, _, kind = rest.rpartition('.')
            squeeze = rest == 'mamba.conv1d.weight'  # [C, 1, K] -> [C, K]
            out[named(LAYER_TENSORS[module], f'.{kind}')] = data.squeeze(1) if squeeze else data
    return out


def write_gguf(tmp_path: Path, kv_heads: list[int] | None = None) -> tuple[Path, torch.nn.Module]:
    """The tiny Jamba written as ``JambaModel`` writes it (``kv_heads``: other per-layer KV heads); returns the file
    and transformers' model of what it holds."""
    src = tmp_path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), 'jamba')
    config = jamba_config()
    config.vocab_size = _add_tokenizer(writer)
    hf = hf_causal_lm(save_random_model(config, str(tmp_path / 'hf')))
    config = hf.config
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(kv_heads or [config.num_key_value_heads if kind == 'attention' else 0
                                          for kind in config.layers_block_type])
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_time_step_rank(config.mamba_dt_rank)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    for name, data in file_tensors(hf).items():
        writer.add_tensor(name, np.ascontiguousarray(data))
    finish(writer)
    return src, hf


def test_gguf_jamba_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, hf = write_gguf(tmp_path)
    engine = make_engine(str(src))
    hf_config = engine.model_config.hf_config
    assert hf_config.layers_block_type == hf.config.layers_block_type
    assert hf_config.layers_num_experts == hf.config.layers_num_experts
    prompts = random_prompts([1, 5, 23, 41], vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


def test_gguf_jamba_with_irregular_attention_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, _ = write_gguf(tmp_path, kv_heads=[2, 0, 2, 2])
    with pytest.raises(ConfigError, match=r'attention layers \[0, 2, 3\] are not one in every n layers'):
        make_engine(str(src))
