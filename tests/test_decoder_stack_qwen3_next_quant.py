"""Qwen3-Next and Qwen3.5 in the native decoder stack over an int8 or int4 KV cache, on W8A8 projections, on a
Q4_K_M-like GGUF file's blocks (Q4_K, Q5_K, Q6_K and Q8_0, a stacked layer's parts each of its own type) and, for
Qwen3.5 with its vision tower, after images (M-RoPE positions): the stack is built, and its decode-only steps give
the hidden states and recurrent states of the layers' own forward bit for bit (as in
test_decoder_stack_qwen3_next.py); so do AWQ and GPTQ checkpoints."""
from __future__ import annotations

from pathlib import Path

import pytest
import quant_models
import vl_models
from conftest import save_random_model
from helpers import random_prompts, run
from test_decoder_stack import ENGINE, save_w8a8
from test_decoder_stack_qwen3_next import SHAPE, compare_decode_steps, hybrid_engine
from test_decoder_stack_qwen3_next import saved, stack_kernels  # noqa: F401  (fixtures)
from test_gguf_qwen3_next import MIXED, random_hybrid
from test_vl_families import PROMPTS as VL_PROMPTS
from test_vl_families import make_processor
from transformers import Qwen3_5TextConfig

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant.int4_cpu import NativeInt4Kernel, TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.w8a8 import NativeW8A8Kernel, W8A8Kernel

# short prompts and few tokens: three sequences decode side by side for a few steps
PROMPTS = random_prompts([9, 20, 5], seed=8, vocab=250)
GEN = GenerationConfig(max_new_tokens=4, ignore_eos=True)


def assert_decode_steps_equal(steps: list[dict], min_rows: int = 2) -> None:
    assert steps and max(step['rows'] for step in steps) >= min_rows
    assert [step['hidden'] for step in steps] == [0.0] * len(steps)
    assert [step['states'] for step in steps] == [0.0] * len(steps)


def assert_everything_given_back(engine: Engine) -> None:
    pool = engine.scheduler.state_pool
    assert pool.num_free == pool.num_slots and not engine.sequences
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def sixteen_value_heads() -> Qwen3_5TextConfig:
    """A tiny Qwen3.5 whose in_proj_b and in_proj_a have 16 rows (a native int8 GEMM panel, eight AWQ outputs
    twice) and every projection's inputs whole groups of 32 (torch's int4 kernel's smallest)."""
    return Qwen3_5TextConfig(intermediate_size=64, **(SHAPE | dict(hidden_size=64, linear_num_value_heads=16,
                                                                   linear_value_head_dim=4)))


@pytest.mark.parametrize('variant,quant_policy', [('qwen3_5', 8), ('qwen3_next', 4)])
def test_quantized_kv_decode_steps_equal_the_layers(variant, quant_policy, saved, stack_kernels, monkeypatch):
    """The gated full-attention layers' KV cache in int8 (Qwen3.5) and int4 (Qwen3-Next)."""
    engine = Engine(saved(variant), PytorchEngineConfig(max_prefill_token_num=48, quant_policy=quant_policy, **ENGINE),
                    show_progress=False)
    assert engine.runner.model.native_stack is not None
    steps = compare_decode_steps(engine, monkeypatch)
    assert [len(out) for out in run(engine, PROMPTS, GEN)] == [4] * 3
    assert_decode_steps_equal(steps, min_rows=3)
    assert_everything_given_back(engine)


@pytest.mark.parametrize('value_heads', [16, 4])
def test_w8a8_decode_steps_equal_the_layers(value_heads, tmp_path, stack_kernels, monkeypatch):
    """Qwen3.5 with every projection int8 (``smooth_quant``), on the int8 GEMM; in_proj_b and in_proj_a (a row per
    value head) too where they fill its panels of 16 rows (sixteen value heads), else (four) on torch's int8 GEMM,
    which the stack runs as a ``w8a8_torch`` projection."""
    config = sixteen_value_heads() if value_heads == 16 else Qwen3_5TextConfig(intermediate_size=64, **SHAPE)
    path = save_w8a8(save_random_model(config, str(tmp_path / 'bf16')), str(tmp_path / 'w8a8'))
    engine = hybrid_engine(path)
    layers = engine.runner.model.layers
    kernels = {(name.rpartition('.')[2], type(module.kernel)) for name, module in layers.named_modules()
               if isinstance(module, Linear)}
    few_rows = NativeW8A8Kernel if value_heads == 16 else W8A8Kernel
    assert kernels == {(name, few_rows if name in ('in_proj_b', 'in_proj_a') else NativeW8A8Kernel)
                       for name, _ in kernels}
    steps = compare_decode_steps(engine, monkeypatch)
    assert [len(out) for out in run(engine, PROMPTS, GEN)] == [4] * 3
    assert_decode_steps_equal(steps, min_rows=3)
    assert_everything_given_back(engine)


def thirty_two_value_heads() -> Qwen3_5TextConfig:
    """A tiny Qwen3.5 whose every projection has outputs in multiples of 32 (AutoGPTQ's packer takes no fewer: it
    packs zero points 32 outputs at a time, so in_proj_b and in_proj_a, a row per value head, need 32 value heads) and
    inputs in whole groups of 32."""
    return Qwen3_5TextConfig(intermediate_size=64, **(SHAPE | dict(hidden_size=64, linear_num_value_heads=32,
                                                                   linear_value_head_dim=4)))


@pytest.mark.parametrize('method', ['awq', 'gptq'])
def test_int4_checkpoint_decode_steps_equal_the_layers(method, tmp_path, stack_kernels, monkeypatch):
    """Qwen3.5 with every projection in 4 bits (AWQ, GPTQ): decode steps of one and of six sequences on the native
    int4 GEMV (torch's int4 kernel, ``int4_torch``, where it is not built), in the stack as in the layers."""
    monkeypatch.setattr(quant_models, 'PROJECTIONS', quant_models.PROJECTIONS + (
        'in_proj_qkv', 'in_proj_z', 'in_proj_b', 'in_proj_a', 'out_proj'))
    source = save_random_model(thirty_two_value_heads(), str(tmp_path / 'bf16'))
    engine = hybrid_engine(quant_models.quantize_checkpoint(source, str(tmp_path / method), method, 32))
    model = engine.runner.model
    expected_kernel = NativeInt4Kernel if cpu.int4_gemv() else TorchInt4Kernel
    assert isinstance(model.layers[0].linear_attn.in_proj_b.kernel, expected_kernel)
    steps = compare_decode_steps(engine, monkeypatch)
    prompts = random_prompts([9, 20, 5, 14, 7, 11], seed=8, vocab=250)
    assert [len(out) for out in run(engine, prompts[:1], GEN)] == [4]
    assert [len(out) for out in run(engine, prompts, GEN)] == [4] * 6
    assert {step['rows'] for step in steps} >= {1, 6}
    assert_decode_steps_equal(steps, min_rows=6)
    assert_everything_given_back(engine)


@pytest.mark.usefixtures('tmp_gguf_cache')
@pytest.mark.parametrize('variant', ['qwen35', 'qwen3next'])
def test_gguf_decode_steps_equal_the_layers(variant, tmp_path: Path, stack_kernels, monkeypatch):
    """A Q4_K_M-like file (test_gguf_qwen3_next.py's ``MIXED``: Q4_K, Q5_K, Q6_K and Q8_0 projections, a stacked
    layer's parts of their own types; Qwen3-Next's Q4_K experts with Q6_K downs) in bf16: each layer on its blocks,
    in the stack too. Qwen3.5's decode steps of 18 sequences take each kind's larger-step path (the blocks
    dequantized for the call) in both."""
    hf = random_hybrid(tmp_path, variant, MIXED)
    engine = hybrid_engine(str(tmp_path / 'model.gguf'))
    steps = compare_decode_steps(engine, monkeypatch)
    lengths = [9, 20, 5] + ([5] * 15 if variant == 'qwen35' else [])
    outs = run(engine, random_prompts(lengths, seed=8, vocab=hf.config.vocab_size), GEN)
    assert [len(out) for out in outs] == [4] * len(lengths)
    assert_decode_steps_equal(steps, min_rows=len(lengths))
    assert_everything_given_back(engine)


def test_decode_steps_after_images_equal_the_layers(tmp_path, stack_kernels, monkeypatch):
    """Qwen3.5 with its vision tower (vl_models.py's tiny model): a text prompt and prompts of one and two images
    decode in the stack, on the M-RoPE positions that follow each image, as the layers decode them."""
    path = vl_models.save_tiny_vl_model('qwen3_5', str(tmp_path))
    prompts = [make_processor(path).process(prompt) for prompt in VL_PROMPTS]
    assert [len(prompt.multimodal) for prompt in prompts] == [0, 1, 2]
    engine = hybrid_engine(path)
    steps = compare_decode_steps(engine, monkeypatch)
    assert [len(out) for out in run(engine, prompts, GEN)] == [4] * 3
    assert_decode_steps_equal(steps, min_rows=3)
    assert_everything_given_back(engine)
