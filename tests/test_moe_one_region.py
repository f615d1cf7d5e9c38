"""A MoE block's routed experts in one OpenMP region (``kernels/cpu/moe_block_region.cpp``): steps of up to 8
tokens on per-expert Q4_K, Q5_K, Q6_K, Q8_0 and int4 (AWQ) projections run every expert's GEMV tiles in one parallel
region; their output equals the layers' Python forward bit for bit (as the per-GEMV path's did), and the stack's
steps still equal the layers'. Larger steps, and other kinds, keep the per-expert path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model
from gguf import GGMLQuantizationType as Q
from helpers import random_prompts, run
from test_decoder_stack import ENGINE, check_every_step
from test_decoder_stack_moe import moe_blocks
from test_gguf_mixed import write_mixed_gguf
from test_moe_quant import quantized_moe

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import Q6KGemv
from lmdeploy.pytorch.weights.gguf import convert_gguf

# Qwen3-MoE GGUF files (two MoE layers of four experts): layer 0's and layer 1's gate, up and down types.
FILES = {
    'q4k_q6k_q8': {'blk.0.ffn_down_exps': Q.Q6_K, 'blk.1.ffn_down_exps': Q.Q8_0, 'default': Q.Q4_K},
    'q6k_q8': {'blk.0.ffn_gate_exps': Q.Q6_K, 'blk.0.ffn_up_exps': Q.Q6_K, 'blk.0.ffn_down_exps': Q.Q6_K,
               'blk.1.ffn_gate_exps': Q.Q8_0, 'blk.1.ffn_up_exps': Q.Q8_0, 'blk.1.ffn_down_exps': Q.Q8_0,
               'default': Q.Q4_K},
    'q5k': {'blk.0.ffn_down_exps': Q.Q5_K, 'default': Q.Q4_K},
}


@pytest.fixture(scope='module')
def needs_gemvs():
    if cpu.int4_gemv() is None or cpu.q6k_gemv() is None or cpu.q8_gemv() is None:
        pytest.skip('the native GEMVs need AVX512-BF16')


def gguf_engine(types: dict[str, Q], tmp: Path) -> Engine:
    write_mixed_gguf('qwen3_moe', tmp / 'hf', tmp / 'model.gguf', types)
    convert_gguf(str(tmp / 'model.gguf'), str(tmp / 'served'))
    return Engine(str(tmp / 'served'), PytorchEngineConfig(max_prefill_token_num=48, **ENGINE), show_progress=False)


def assert_blocks_in_one_region(engine: Engine) -> None:
    """Each MoE block of the stack of small steps (decode rows: the GGUF experts' GEMVs) runs steps of 1, 2 and 8
    tokens in one region (not 9 nor 40), and its output equals the layers' forward at 1, 2, 3, 8 (one region) and 40
    tokens (per expert; the GEMVs' too outside an engine step, 40 tokens giving no expert more than their bound)."""
    blocks = moe_blocks(engine)
    assert blocks
    g = torch.Generator().manual_seed(0)
    for block in blocks:
        native = block.native_moe(small_step=True)
        assert [native.experts_in_one_region(tokens=t) for t in (1, 2, 8, 9, 40)] == [True] * 3 + [False] * 2
        for tokens in (1, 2, 3, 8, 40):
            x = torch.randn(tokens, block.experts.hidden_size, generator=g).bfloat16()
            assert torch.equal(native(x=x), block(x)), tokens


def assert_steps_equal_the_layers(engine: Engine, monkeypatch) -> None:
    """Four prompts, each step through the stack and the layers with equal hidden states, decode steps of 1 and 4
    rows among them."""
    steps = check_every_step(engine, monkeypatch)
    prompts = random_prompts([20, 70, 9, 33], seed=8, vocab=250)
    outs = run(engine, prompts, GenerationConfig(max_new_tokens=6, ignore_eos=True))
    run(engine, prompts[:1], GenerationConfig(max_new_tokens=3, ignore_eos=True))
    assert [len(out) for out in outs] == [6] * 4
    assert (0, 1) in steps and (0, 4) in steps


@pytest.mark.parametrize('name', sorted(FILES))
def test_gguf_experts_in_one_region(name, tmp_path, needs_gemvs, native_gemms, monkeypatch):
    """Q4_K gate_up (its SiLU in the GEMV) with Q6_K, Q8_0 or Q5_K downs, and Q6_K and Q8_0 gate_up (SiLU after
    their bf16 results), in one region, equal to the layers' forward."""
    engine = gguf_engine(FILES[name], tmp_path)
    try:
        kernels = {type(block.experts.kernel.kernel(proj, 0).small).__name__ for block in moe_blocks(engine)
                   for proj in ('gate_up', 'down')}
        if name == 'q6k_q8':
            assert {Q6KGemv.__name__, Q8_0Gemv.__name__} <= kernels, kernels
        assert_blocks_in_one_region(engine)
        assert_steps_equal_the_layers(engine, monkeypatch)
    finally:
        engine.close()


def test_int4_experts_in_one_region(tmp_path, needs_gemvs, native_gemms):
    """AWQ experts on the int4 GEMV (its SiLU fused), in one region, equal to the layers' forward (the blocks alone:
    AWQ attention does not run in the stack)."""
    path, _ = quantized_moe(str(tmp_path), 'qwen3_moe', 'awq', 128, False)
    engine = Engine(path, PytorchEngineConfig(**ENGINE), show_progress=False)
    try:
        assert_blocks_in_one_region(engine)
    finally:
        engine.close()


def test_dense_experts_keep_the_per_expert_path(tmp_path, native_gemms):
    """Dense bf16 experts (fused_moe's weights) never run in one region."""
    engine = Engine(save_tiny_model('qwen3_moe', str(tmp_path)), PytorchEngineConfig(**ENGINE), show_progress=False)
    try:
        assert not any(block.native_moe().experts_in_one_region(tokens=1) for block in moe_blocks(engine))
    finally:
        engine.close()
