"""GraniteMoeShared from GGUF (llama.cpp's ``granitemoe`` with a shared MLP): a tiny random
``GraniteMoeSharedForCausalLM`` written as convert_hf_to_gguf.py's ``GraniteMoeModel`` writes it (Granite 3 MoE's
file, the shared MLP's fused ``input_linear`` split into ``ffn_gate_shexp`` and ``ffn_up_shexp``, ``output_linear`` as
``ffn_down_shexp``, its width as ``expert_shared_feed_forward_length``), read back into the checkpoint bit for bit
and served token for token like transformers; in Q8_0 the shared MLP's projections served as their blocks beside the
attention's and the experts'."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_gguf_olmoe_granitemoe_starcoder2 import save_gguf
from test_gguf_qwen3_next import layer_types
from test_granitemoeshared import granitemoeshared_config

from family_checks import hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf_llama_like import converted_model


pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


def test_f32_file_is_the_checkpoint_and_matches_transformers(tmp_path: Path) -> None:
    """Converted, the folder is the GraniteMoeShared checkpoint (its shared MLP's ``input_linear`` fused again) bit
    for bit, of the same shared width; the engine's 32 greedy tokens equal transformers'."""
    src, folder, vocab = save_gguf('granitemoe', tmp_path, quantize=False, make_config=granitemoeshared_config)
    hf = hf_causal_lm(folder)
    converted = converted_model(src, tmp_path, hf)
    assert converted.config.shared_intermediate_size == hf.config.shared_intermediate_size == 96
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(make_engine(str(src)), prompts))


def test_q8_0_shared_mlp_kept_as_blocks(tmp_path: Path) -> None:
    """In Q8_0 the attention's projections, the experts and the shared MLP's gate/up and down are served as their
    blocks (only the routers are dense), token for token like transformers on the weights they hold."""
    src, folder, vocab = save_gguf('granitemoe', tmp_path, quantize=True, make_config=granitemoeshared_config)
    hf = hf_causal_lm(folder)
    engine = make_engine(str(src))
    types = layer_types(engine.runner.model)
    layers = range(hf.config.num_hidden_layers)
    assert {name for name, kind in types.items() if kind == 'dense'} == {f'layers.{i}.mlp.gate' for i in layers}
    served = ('self_attn.qkv_proj', 'self_attn.o_proj', 'mlp.experts.gate_up', 'mlp.experts.down',
              'mlp.shared_mlp.gate_up_proj', 'mlp.shared_mlp.down_proj')
    assert all(types[f'layers.{i}.{name}'] == 'Q8_0' for i in layers for name in served), types
    prompts = random_prompts([5, 40], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
