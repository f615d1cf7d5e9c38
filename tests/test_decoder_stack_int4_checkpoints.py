"""AWQ and GPTQ checkpoints in the native decoder stack (bf16): every step on the native int4 GEMV over the
checkpoint's grid (``int4`` projections; torch's int4 kernel, ``int4_torch``, where it is not built), every step's hidden states equal to the layers' own forward on the same kernels (Llama and Qwen3
dense, Qwen3-MoE with its 4-bit experts); act-order GPTQ keeps the layers. Qwen3.5's:
test_decoder_stack_qwen3_next_quant.py."""
from __future__ import annotations

import pytest
from conftest import save_tiny_model
from helpers import random_prompts, run
from quant_models import quantize_checkpoint
from test_decoder_stack import ENGINE, check_every_step

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant.int4_cpu import NativeInt4Kernel, TorchInt4Kernel

# sizes whose every projection fills the GEMV's tiles (16 rows, gate-and-up 32) and takes groups of 32
SHAPE = dict(hidden_size=64, intermediate_size=128)
# one prompt alone (batch-1 decode), then six side by side: decode steps of 6 rows pass the GEMV's bound
PROMPTS = random_prompts([20, 70, 9, 33, 5, 12], seed=8)
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)


def quantized(kind: str, tmp_path, method: str, desc_act: bool = False) -> str:
    """A tiny random ``kind`` (conftest's; Qwen3-MoE's as it is) quantized in groups of 32."""
    source = save_tiny_model(kind, str(tmp_path / 'fp32'), **({} if kind == 'qwen3_moe' else SHAPE))
    return quantize_checkpoint(source, str(tmp_path / method), method, 32, desc_act)


def assert_everything_given_back(engine: Engine) -> None:
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences


@pytest.mark.parametrize('kind,method', [('llama', 'awq'), ('llama', 'gptq'), ('qwen3', 'awq'), ('qwen3_moe', 'gptq')])
def test_stack_equals_the_layers(kind, method, tmp_path, native, monkeypatch):
    """Every step through the stack and through the layers gives the same hidden states: prefills and decode of one,
    three and six rows, on the GEMV where it is built (one copy of the weight; no stack of small steps)."""
    engine = Engine(quantized(kind, tmp_path, method), PytorchEngineConfig(max_prefill_token_num=48, **ENGINE),
                    show_progress=False)
    model = engine.runner.model
    stack, gemv = model.native_stack, cpu.int4_gemv() is not None
    assert stack is not None
    assert stack.small is None
    kinds = {type(module.kernel) for name, module in model.layers.named_modules()
             if isinstance(module, Linear) and not name.endswith(('gate', 'router'))}
    assert kinds == {NativeInt4Kernel if gemv else TorchInt4Kernel}
    steps = check_every_step(engine, monkeypatch)
    run(engine, PROMPTS[:1], GEN)
    assert [len(out) for out in run(engine, PROMPTS[:3], GEN)] == [6] * 3
    assert [len(out) for out in run(engine, PROMPTS, GEN)] == [6] * 6
    assert {(0, 1), (0, 3), (0, 6)} <= set(steps) and any(prefill > 6 for prefill, _ in steps)
    assert_everything_given_back(engine)


def test_act_order_gptq_keeps_the_layers(tmp_path, native):
    """An act-order GPTQ layer gathers its inputs in the checkpoint's order before each kernel, which no projection of
    the stack does: the model runs its layers' forward (on the GEMV as above), and serves."""
    engine = Engine(quantized('llama', tmp_path, 'gptq', desc_act=True), PytorchEngineConfig(**ENGINE),
                    show_progress=False)
    model = engine.runner.model
    assert model.native_stack is None
    assert all(module.kernel.order is not None
               for module in model.layers.modules() if isinstance(module, Linear))
    assert [len(out) for out in run(engine, PROMPTS[:3], GEN)] == [6] * 3
    assert_everything_given_back(engine)
