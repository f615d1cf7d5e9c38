"""MiniMax-M2 and GLM-4.7-Flash in the native decoder stack (bf16 on the native GEMMs): every layer in the stack,
the MoE layers as ``MoEBlock``s routed ``noaux_tc``, equal to the layers' forward at every step (chunked prefills,
mixed and decode steps), batched equal to solo. MiniMax-M2's attention norms q and k over all heads
(``qk_norm_across_heads``) before a partial rotary; GLM-4.7-Flash's is DeepSeek-V3's latent attention (``mla``)."""
from __future__ import annotations

import pytest
from test_decoder_stack_moe import assert_two_moe_layers_in_the_stack
from test_glm4_moe_lite import VARIANTS, save_glm4_moe_lite
from test_minimax_m2 import minimax_m2_config

from conftest import save_random_model

MODELS = {'minimax_m2': lambda path: save_random_model(minimax_m2_config(), path,
                                                       std={'e_score_correction_bias': 0.3}),
          **{f'glm4_moe_lite_{name}': (lambda path, name=name: save_glm4_moe_lite(path, **VARIANTS[name]))
             for name in VARIANTS}}


@pytest.mark.parametrize('model', sorted(MODELS))
def test_stack_equals_the_layers(model, tmp_path, native_gemms, monkeypatch):
    assert_two_moe_layers_in_the_stack(MODELS[model](str(tmp_path / model)), monkeypatch)
