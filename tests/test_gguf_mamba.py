"""Mamba and Falcon Mamba from GGUF (llama.cpp's ``mamba``): tiny random transformers models written as
convert_hf_to_gguf.py's ``MambaModel`` writes them (no heads, the mixer's sizes as ``ssm.*`` keys, Falcon Mamba by
``ssm.dt_b_c_rms``; ``A`` as ``-exp(A_log)`` and ``D`` without a ``.weight``, the convolution squeezed, the LM head
left out where tied), served by the engine token for token like transformers, with no KV cache."""
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
from test_mamba import VARIANTS

# transformers' name in a block -> the file's tensor
BLOCK_TENSORS = {'norm': T.ATTN_NORM, 'mixer.in_proj': T.SSM_IN, 'mixer.conv1d': T.SSM_CONV1D,
                 'mixer.x_proj': T.SSM_X, 'mixer.dt_proj': T.SSM_DT, 'mixer.out_proj': T.SSM_OUT,
                 'mixer.A_log': T.SSM_A, 'mixer.D': T.SSM_D}
GLOBAL_TENSORS = {'backbone.embeddings.weight': T.TOKEN_EMBD, 'backbone.norm_f.weight': T.OUTPUT_NORM,
                  'lm_head.weight': T.OUTPUT}


def write_gguf(tmp_path: Path, variant: str) -> tuple[Path, torch.nn.Module]:
    """A tiny random model of ``variant`` written as ``MambaModel`` writes it; returns the file and transformers'
    model of what it holds."""
    src = tmp_path / 'model.gguf'
    writer = gguf.GGUFWriter(str(src), 'mamba')
    config = VARIANTS[variant]()
    config.vocab_size = _add_tokenizer(writer)
    hf = hf_causal_lm(save_random_model(config, str(tmp_path / 'hf')))
    config = hf.config
    writer.add_context_length(2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_ssm_conv_kernel(config.conv_kernel)
    writer.add_ssm_inner_size(config.intermediate_size)
    writer.add_ssm_state_size(config.state_size)
    writer.add_ssm_time_step_rank(config.time_step_rank)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    writer.add_ssm_dt_b_c_rms(variant == 'falcon_mamba')
    state = hf.state_dict()
    for name, param in state.items():
        data = param.detach().numpy()
        if name in GLOBAL_TENSORS:
            if name == 'lm_head.weight' and torch.equal(param, state['backbone.embeddings.weight']):
                continue  # tied: the converter omits it
            writer.add_tensor(gguf.TENSOR_NAMES[GLOBAL_TENSORS[name]] + '.weight', np.ascontiguousarray(data))
            continue
        if not name.startswith('backbone.layers.') or 'layernorm' in name:  # Falcon Mamba's weightless norms
            continue
        layer, _, rest = name.removeprefix('backbone.layers.').partition('.')
        module, _, kind = rest.rpartition('.')
        if rest in ('mixer.A_log', 'mixer.D'):
            module, kind = rest, None
            data = -np.exp(data) if rest == 'mixer.A_log' else data
        elif rest == 'mixer.conv1d.weight':
            data = data.squeeze(1)
        file_name = gguf.TENSOR_NAMES[BLOCK_TENSORS[module]].format(bid=layer) + (f'.{kind}' if kind else '')
        writer.add_tensor(file_name, np.ascontiguousarray(data))
    finish(writer)
    return src, hf


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_gguf_mamba_matches_transformers(variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src, hf = write_gguf(tmp_path, variant)
    engine = make_engine(str(src))
    assert engine.model_config.architecture == hf.config.architectures[0]
    assert engine.runner.cfg.kv_bytes_per_token() == 0
    # not the converter's arbitrary 2**20 context (sized from memory: 4M blocks counting tokens, 16 s at start-up)
    assert engine.model_config.max_position_embeddings == 4096
    prompts = random_prompts([1, 5, 23, 41], vocab=hf.config.vocab_size)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
