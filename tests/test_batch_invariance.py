"""A prompt's output does not depend on what else shares its steps, on the paths with kernels of their own for small
steps (``decode_int4``'s 4-bit copies, the LM head's one-row copy): greedy tokens and their logprobs, bitwise, of
prompts run together (decode steps of more rows than the small-step bound) and arriving one a step (their
prefills sharing steps with others' decode rows) equal each prompt's run alone."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from helpers import random_prompts

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.nn.quant.q8_cpu import Q8Gemv, pack_q8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run  # noqa: E402

GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)



def assert_batch_invariant(engine: Engine, prompts: list[list[int]]) -> None:
    alone = [run(engine, [prompt], GEN, 0)[0] for prompt in prompts]
    assert run(engine, prompts, GEN, 0) == alone  # prefills together, then decode steps of len(prompts) rows
    assert run(engine, prompts, GEN, 1) == alone  # each prefill beside the decode rows of the prompts before it


@pytest.mark.parametrize('decoder', ['stack', 'layers'])
def test_tiny_int4_small_steps_are_batch_invariant(decoder, tiny_llama, native_gemms):
    """bf16 with 4-bit small steps (and the fp16 LM head copy), in the native stack and in the layers' forward:
    prompts of one and two tokens (once small steps by their size), decode steps of up to six rows (the bound
    is two)."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    engine = Engine(tiny_llama, PytorchEngineConfig(dtype='bfloat16', decode_int4=True, num_gpu_blocks=64,
                                                    block_size=16, enable_prefix_caching=False), show_progress=False)
    model = engine.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj.kernel, SmallStepInt4Kernel)
    assert model.lm_head.fp16 is not None and model.native_stack.small is not None
    if decoder == 'layers':
        model.native_stack = None
    assert_batch_invariant(engine, random_prompts([1, 2, 5, 9, 17, 40], seed=3))


def test_default_model_is_batch_invariant(default_model_gguf):
    """The default model as ``lmdeploy chat`` runs it: bf16, its Q4_1 layers' 4-bit small steps, the Q8_0 LM
    head's 8-bit copy."""
    engine = Engine(default_model_gguf, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=32),
                    show_progress=False)
    assert engine.runner.model.lm_head.q8 is not None
    assert_batch_invariant(engine, random_prompts([3, 12, 30, 7], seed=1, vocab=40000))


def test_q8_gemv_rows_do_not_depend_on_their_number(native):
    """Each row of the 8-bit GEMV's output, bitwise, whether it runs alone or beside others."""
    if cpu.q8_gemv() is None:
        pytest.skip('the native Q8 GEMV needs AVX512-BF16')
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (64, 96), generator=g, dtype=torch.int8)
    gemv = Q8Gemv(*pack_q8(codes, (torch.rand(64, 3, generator=g) / 50).half()))
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(7, 96, generator=g).to(dtype)
        rows = gemv(x)
        assert all(torch.equal(rows[i:i + 1], gemv(x[i:i + 1])) for i in range(7))
