"""fp32 on the CPU is batch invariant: the decoder's linear layers and the LM head run the native fixed-order fp32
GEMM (``fp32_packed_linear``, AVX-512 or AVX2 with FMA), whose rows, bitwise, do not depend on their number (torch's
fp32 GEMM picks its kernel, and its order of summation, by it), so a prompt's greedy tokens and logprobs, bitwise, are
the same alone, together with others and arriving beside others' decode steps."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import save_random_model, save_tiny_model
from helpers import random_prompts
from test_deepseek import save_deepseek
from test_gpt_oss import save_gpt_oss, save_mxfp4
from test_qwen3_next import VARIANTS as QWEN3_NEXT_VARIANTS
from test_sliding_kv import llama4_config

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU, clamped_swiglu
from lmdeploy.pytorch.nn.moe import Fp32Router
from lmdeploy.pytorch.nn.quant.cpu_fp32 import NativeFp32Kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run  # noqa: E402

GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture
def fp32_gemm(native):
    if cpu.fp32_gemm() is None:
        pytest.skip('the native fp32 GEMM needs AVX-512')
    return native


@pytest.fixture(params=['avx512', 'avx2'])
def fp32_isa(request, fp32_gemm) -> str:
    """Each instruction set the native fp32 GEMM was built for here (an AVX-512 CPU builds and runs the AVX2 kernel
    too: ``LMDEPLOY_CPU_FP32_GEMM=avx2`` picks it)."""
    if request.param not in fp32_gemm.fp32_packed_linear_isas():
        pytest.skip(f'fp32_packed_linear is not built for {request.param} here')
    return request.param


@pytest.mark.parametrize('threads', [1, 2])
@pytest.mark.parametrize('outputs', [197, 203])
def test_packed_rows_do_not_depend_on_their_number_or_place(fp32_gemm, fp32_isa, threads, outputs):
    """Each of 64 rows, bitwise, the same alone and among 2, 5, 17 or 64 rows at any place in the call (the last
    tile 5 or 11 outputs: AVX2's second vector of it empty or partial; an odd number of inputs; a bias), and within
    the fp32 error bound of the exact product."""
    inputs = 97
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(outputs, inputs, generator=g), torch.randn(outputs, generator=g)
    packed = fp32_gemm.pack_fp32_weight(weight)
    assert packed.shape == (13, inputs, 16)
    x = torch.randn(64, inputs, generator=g)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([fp32_gemm.fp32_packed_linear(x[i:i + 1], packed, outputs, bias, fp32_isa)
                           for i in range(64)])
        for m in (2, 5, 17, 64):
            for start in sorted({0, (64 - m) // 2, 64 - m}):
                together = fp32_gemm.fp32_packed_linear(x[start:start + m], packed, outputs, bias, fp32_isa)
                assert torch.equal(together, alone[start:start + m]), (m, start)
    finally:
        torch.set_num_threads(previous)
    # K FMAs and the bias's add, one rounding each: |error| <= gamma(K + 1) * (sum_k |x_k w_k| + |b|), gamma(j) =
    # j u / (1 - j u), u = 2^-24 (recursive summation's bound).
    exact = x.double() @ weight.double().T + bias.double()
    magnitude = x.double().abs() @ weight.double().abs().T + bias.double().abs()
    steps = (inputs + 1) * 2.0 ** -24
    assert ((alone.double() - exact).abs() <= steps / (1 - steps) * magnitude).all()


def test_avx2_and_avx512_kernels_give_the_same_bits(fp32_gemm):
    """Each output one FMA chain in input order on either instruction set: the same bits from both."""
    if fp32_gemm.fp32_packed_linear_isas() != ['avx512', 'avx2']:
        pytest.skip('needs both builds of fp32_packed_linear (an AVX-512 CPU)')
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(203, 97, generator=g), torch.randn(203, generator=g)
    packed = fp32_gemm.pack_fp32_weight(weight)
    for m in (1, 5, 17, 64):
        x = torch.randn(m, 97, generator=g)
        assert torch.equal(fp32_gemm.fp32_packed_linear(x, packed, 203, bias, 'avx2'),
                           fp32_gemm.fp32_packed_linear(x, packed, 203, bias, 'avx512')), m


def test_an_fp32_gemm_isa_not_built_is_an_error(fp32_gemm, monkeypatch):
    monkeypatch.setenv('LMDEPLOY_CPU_FP32_GEMM', 'sse2')
    with pytest.raises(ValueError, match='built here for'):
        cpu.fp32_gemm_isa()


def test_the_stacks_fp32_projection_runs_the_chosen_isa(fp32_isa, monkeypatch):
    """An fp32 router's projection in the native stack runs the instruction set its Python kernel was packed for
    (``LMDEPLOY_CPU_FP32_GEMM``; it took the widest before), one not built is an error, and every way gives the
    Python layer's bits."""
    monkeypatch.setenv('LMDEPLOY_CPU_FP32_GEMM', fp32_isa)
    router = Fp32Router(301, 37)
    router.weight = torch.nn.Parameter(torch.randn(37, 301, generator=torch.Generator().manual_seed(0)),
                                       requires_grad=False)
    router.finalize()
    projection = router.native_projection()
    assert router.kernel.isa == projection.isa == fp32_isa
    x = torch.randn(23, 301, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = router(x)
    assert torch.equal(projection(x=x), expected)
    native = cpu.native()
    for isa in native.fp32_packed_linear_isas():
        other = native.Projection(kind='fp32', weight=router.kernel.packed, outputs=37, isa=isa)
        assert other.isa == isa and torch.equal(other(x=x), expected)
    with pytest.raises(RuntimeError, match='not built for sse2'):
        native.Projection(kind='fp32', weight=router.kernel.packed, outputs=37, isa='sse2')


def test_clamped_swiglu_rows_do_not_depend_on_their_place():
    """gpt-oss's activation on 64 rows of an intermediate size not a multiple of 32 (torch's fp32 sigmoid takes a
    tensor's last elements on a scalar exp, a bit apart from its vector one; 14 of 2,560 values differed): each
    row, bitwise, as alone."""
    gate_up = torch.randn(64, 80, generator=torch.Generator().manual_seed(0)) * 3
    together = clamped_swiglu(gate_up, ClampedSwiGLU())
    assert torch.equal(together, torch.cat([clamped_swiglu(row[None], ClampedSwiGLU()) for row in gate_up]))


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


def test_tiny_llama_fp32_is_batch_invariant(tiny_llama, fp32_isa, monkeypatch):
    """On each instruction set of the native fp32 GEMM (the AVX2 kernel, as a CPU without AVX-512 runs it, forced
    by ``LMDEPLOY_CPU_FP32_GEMM``)."""
    monkeypatch.setenv('LMDEPLOY_CPU_FP32_GEMM', fp32_isa)
    engine = fp32_engine(tiny_llama)
    kernels = [engine.runner.model.lm_head.packed, engine.runner.model.layers[0].self_attn.qkv_proj.kernel]
    assert all(isinstance(kernel, NativeFp32Kernel) and kernel.isa == fp32_isa for kernel in kernels)
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


def test_tiny_qwen2_moe_fp32_is_batch_invariant(tmp_path, fp32_gemm):
    """Its shared expert's sigmoid gate runs ``placeless`` (in fp64): torch's fp32 sigmoid gave the tensor's last
    elements, on its scalar path, other bits than the vector path gave them among more rows (1 of 6 prompts'
    logprobs differed)."""
    engine = fp32_engine(save_tiny_model('qwen2_moe', str(tmp_path)))
    assert_batch_invariant(engine, random_prompts([1, 2, 5, 9, 17, 40], seed=3))


def test_tiny_llama4_fp32_is_batch_invariant(tmp_path, fp32_gemm):
    """Its router's sigmoid, which scales each expert's input, runs ``placeless`` (2 of 6 prompts' logprobs
    differed)."""
    engine = fp32_engine(save_random_model(llama4_config(16), str(tmp_path)))
    assert_batch_invariant(engine, random_prompts([1, 2, 5, 9, 17, 40], seed=3))


@pytest.mark.parametrize('budget', [100, 16])
def test_tiny_qwen3_5_fp32_is_batch_invariant(tmp_path, fp32_gemm, budget):
    """Its linear-attention layers' element-wise ops over the step's rows (the gated norm's SiLU, ``b``'s sigmoid,
    ``a``'s softplus) and the full-attention layers' output gate run ``placeless``, and prefill chunks end on the
    delta rule's chunks: prompts of up to 200 tokens in chunks of at most 100, alone and arriving one a step beside
    others' decode rows (all three differed). A budget of 16 beside up to 3 others cuts every chunk at the next
    multiple of 13 (``recurrent_grain``; before, where the budget ended: the 140-token prompt's logprobs differed)."""
    path = save_random_model(QWEN3_NEXT_VARIANTS['qwen3_5'](), str(tmp_path))
    engine = Engine(path, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16, max_batch_size=4,
                                              max_prefill_token_num=budget), show_progress=False)
    prompts = random_prompts([9, 140, 200], seed=11)
    alone = [run(engine, [prompt], GEN, 0)[0] for prompt in prompts]
    assert run(engine, prompts, GEN, 1) == alone
