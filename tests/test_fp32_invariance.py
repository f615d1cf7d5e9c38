"""fp32 on the CPU is batch invariant: the decoder's linear layers and the LM head run the native fixed-order fp32
GEMM (``fp32_packed_linear``), whose rows, bitwise, do not depend on their number (torch's fp32 GEMM picks its kernel,
and its order of summation, by it), so a prompt's greedy tokens and logprobs, bitwise, are the same alone, together
with others and arriving beside others' decode steps."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_model
from helpers import random_prompts
from test_deepseek import save_deepseek
from test_gpt_oss import save_gpt_oss, save_mxfp4

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.cpu_fp32 import NativeFp32Kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run  # noqa: E402

GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture
def fp32_gemm(native):
    if cpu.fp32_gemm() is None:
        pytest.skip('the native fp32 GEMM needs AVX-512')
    return native


@pytest.mark.parametrize('threads', [1, 2])
def test_packed_rows_do_not_depend_on_their_number(fp32_gemm, threads):
    """Each row of ``M = 1..40`` rows, bitwise, as alone and among 40 (outputs not a multiple of 16, a bias), and
    within fp32 rounding of ``F.linear``."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(203, 96, generator=g), torch.randn(203, generator=g)
    packed = fp32_gemm.pack_fp32_weight(weight)
    assert packed.shape == (13, 96, 16)
    x = torch.randn(40, 96, generator=g)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = fp32_gemm.fp32_packed_linear(x, packed, 203, bias)
        alone = torch.cat([fp32_gemm.fp32_packed_linear(x[i:i + 1], packed, 203, bias) for i in range(40)])
        assert torch.equal(together, alone)
        for m in range(1, 41):
            assert torch.equal(fp32_gemm.fp32_packed_linear(x[40 - m:], packed, 203, bias), together[40 - m:]), m
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(together, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def fp32_engine(path: str) -> Engine:
    engine = Engine(path, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16,
                                              enable_prefix_caching=False), show_progress=False)
    assert isinstance(engine.runner.model.lm_head.packed, NativeFp32Kernel)
    assert engine.runner.model.native_stack is None  # fp32 runs the layers' forward
    return engine


def assert_batch_invariant(engine: Engine, prompts: list[list[int]]) -> None:
    alone = [run(engine, [prompt], GEN, 0)[0] for prompt in prompts]
    assert run(engine, prompts, GEN, 0) == alone  # prefills together, then decode steps of len(prompts) rows
    assert run(engine, prompts, GEN, 1) == alone  # each prefill beside the decode rows of the prompts before it


def test_tiny_llama_fp32_is_batch_invariant(tiny_llama, fp32_gemm):
    engine = fp32_engine(tiny_llama)
    assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj.kernel, NativeFp32Kernel)
    assert_batch_invariant(engine, random_prompts([1, 2, 5, 9, 17, 40], seed=3))


def test_tiny_qwen3_moe_fp32_is_batch_invariant(tmp_path, fp32_gemm):
    """Its router a linear layer, each expert's projections on their own packed copy (``native_fp32_experts``)."""
    engine = fp32_engine(save_tiny_model('qwen3_moe', str(tmp_path)))
    mlp = engine.runner.model.layers[0].mlp
    assert isinstance(mlp.gate.kernel, NativeFp32Kernel) and isinstance(mlp.experts.kernel.kernel('down', 0),
                                                                         NativeFp32Kernel)
    assert_batch_invariant(engine, random_prompts([1, 2, 5, 9, 17, 40], seed=3))


def test_tiny_deepseek_v3_fp32_is_batch_invariant(tmp_path, fp32_gemm):
    """Its latent attention's per-head products (absorbed queries, values) each on a head's packed copies of
    ``kv_b_proj`` (``LatentAttention.pack_heads``; ``torch.einsum``'s rows depend on their number) and its fp32
    router on the packed kernel (``Fp32Router``)."""
    engine = fp32_engine(save_deepseek(str(tmp_path)))
    layer = engine.runner.model.layers[1]
    assert layer.self_attn.attn.value_kernels is not None and isinstance(layer.mlp.gate.kernel, NativeFp32Kernel)
    assert_batch_invariant(engine, random_prompts([1, 2, 5, 9, 17, 40], seed=3))



def test_tiny_gpt_oss_mxfp4_fp32_is_batch_invariant(tmp_path, fp32_gemm):
    """Its MXFP4 experts' prefill rows on the weight dequantized and packed for the call (torch's fp32 GEMM rounded
    an expert's 1 to 3 prefill rows apart from more); decode rows on the MXFP4 GEMV."""
    engine = fp32_engine(save_mxfp4(save_gpt_oss(str(tmp_path / 'dense')), str(tmp_path / 'mxfp4')))
    assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj.kernel, NativeFp32Kernel)
    assert_batch_invariant(engine, random_prompts([1, 2, 5, 9, 17, 40], seed=3))
