"""A mixture-of-experts layer's output for a token does not depend on what else shares its step: an expert's
kernel gives each row the same bits whatever the number of rows routed to it (dense bf16 experts on the native
GEMM, where torch's bf16 GEMM rounds a lone row apart), MXFP4 and GGUF K-quant experts choose their kernel by the
kind of rows (decode rows on the GEMV, prefill rows on the dequantized weight) rather than by their share's size,
fp32 routers sum each row in input order (``Fp32Router`` on ``fp32_packed_linear``), and bf16 routers and gates of a
few outputs run the native GEMM on panels padded with zero rows. Tiny random models saved by transformers: a MoE
block's rows alone and together, and an engine's greedy tokens and logprobs, bitwise, each prompt alone against all
together and arriving one a step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_model
from helpers import random_prompts
from test_batch_invariance import assert_batch_invariant
from test_deepseek import save_deepseek
from test_gguf_mixed import served_mixed_gguf
from test_gguf_moe import FILES as GGUF_MOE_FILES
from test_gpt_oss import save_gpt_oss, save_mxfp4

from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.models.moe import SparseMoeBlock
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import Fp32Router
from lmdeploy.pytorch.nn.quant import LinearOptions
from lmdeploy.pytorch.nn.quant.cpu_bf16 import NativeBf16Kernel
from lmdeploy.pytorch.nn.quant.q6k_cpu import GEMV_MAX_ROWS

CONFIG = dict(num_gpu_blocks=128, block_size=16, enable_prefix_caching=False)


def engine_of(path: str, dtype: str = 'bfloat16', decoder: str = 'stack') -> Engine:
    engine = Engine(path, PytorchEngineConfig(dtype=dtype, **CONFIG), show_progress=False)
    if decoder == 'layers':
        engine.runner.model.native_stack = None
    return engine


@pytest.fixture(scope='module')
def qwen3_moe(tmp_path_factory) -> str:
    return save_tiny_model('qwen3_moe', str(tmp_path_factory.mktemp('qwen3_moe')), num_experts=8)


@pytest.fixture(scope='module')
def deepseek_v3(tmp_path_factory) -> str:
    return save_deepseek(str(tmp_path_factory.mktemp('deepseek_v3')))


@pytest.fixture(scope='module')
def gpt_oss_bf16(tmp_path_factory) -> str:
    """gpt-oss with bf16 experts of an intermediate size of 40 (its clamped SwiGLU on rows of 40 features)."""
    return save_gpt_oss(str(tmp_path_factory.mktemp('gpt_oss_bf16')), intermediate_size=40)


@pytest.mark.parametrize('model', ['qwen3_moe', 'deepseek_v3', 'gpt_oss_bf16'])
def test_moe_block_rows_do_not_depend_on_their_number(model, request, native_gemms):
    """A bf16 MoE block's rows, bitwise, run all together (experts' shares of many rows) and one at a time (shares
    of one), in the layers' forward and in the native stack's ``MoEBlock``: torch's bf16 GEMM (Qwen3-MoE's dense
    experts) and fp32 GEMM (DeepSeek-V3's fp32 router) differed on some of these 1024 rows; gpt-oss's clamped SwiGLU
    (the block's own, in torch's ops) did not (see :func:`test_bf16_sigmoid_does_not_depend_on_its_place`)."""
    engine = engine_of(request.getfixturevalue(model))
    try:
        block = engine.runner.model.layers[-1].mlp
        x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
        for moe in (block, block.native_moe()):
            together = moe(x)
            assert all(torch.equal(together[i:i + 1], moe(x[i:i + 1])) for i in range(x.shape[0]))
    finally:
        engine.close()


def test_bf16_sigmoid_does_not_depend_on_its_place():
    """torch's bf16 sigmoid gives every bf16 value the same bits on its vector path and on its scalar one (a
    tensor's last elements), so the MoE block's clamped SwiGLU in bf16 (``MoEBlock::activate``, the layers'
    ``clamped_swiglu``) gives a row the same bits wherever it sits; in fp32 the two paths' exps differ in the last
    bit (for 116 of these values here), which is why ``clamped_swiglu``'s fp32 sigmoid runs in fp64."""
    values = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[~values.isnan()]
    vector = torch.cat([values, values[:64]]).sigmoid()[:values.numel()]  # the tail past the values
    scalar = torch.stack([values, values], dim=1)[:, 0].sigmoid()  # strided: the scalar loop for every element
    assert torch.equal(vector.view(torch.int16), scalar.view(torch.int16))


@pytest.fixture(scope='module')
def gpt_oss_mxfp4(tmp_path_factory) -> str:
    dense = save_gpt_oss(str(tmp_path_factory.mktemp('gpt_oss_dense')))
    return save_mxfp4(dense, str(tmp_path_factory.mktemp('gpt_oss_mxfp4') / 'model'))


@pytest.mark.parametrize('decoder', ['stack', 'layers'])
def test_mxfp4_experts_choose_by_the_kind_of_rows(gpt_oss_mxfp4, decoder, native_gemms):
    """gpt-oss with MXFP4 experts (4 experts, top-2) in bf16: 24 prompts decoding together give an expert more rows
    than the GEMV's bound outside a step (16), which then ran on the dequantized weight; prefills of one and two
    tokens gave shares that ran on the GEMV."""
    if cpu.mxfp4_gemv() is None:
        pytest.skip('the native MXFP4 GEMV is not built')
    engine = engine_of(gpt_oss_mxfp4, decoder=decoder)
    try:
        assert_batch_invariant(engine, random_prompts([1, 2] + [3 + 5 * i for i in range(22)], seed=5))
    finally:
        engine.close()


@pytest.fixture(scope='module')
def wide_gpt_oss_mxfp4(tmp_path_factory) -> str:
    """gpt-oss of hidden 2048 with MXFP4 experts: their gate-and-up projections' 2048 inputs are where oneDNN's bf16
    GEMM rounded a lone row apart from the same row among others."""
    dense = save_gpt_oss(str(tmp_path_factory.mktemp('gpt_oss_wide')), hidden_size=2048, intermediate_size=256)
    return save_mxfp4(dense, str(tmp_path_factory.mktemp('gpt_oss_wide_mxfp4') / 'model'))


def test_mxfp4_prefills_of_a_token_are_batch_invariant(wide_gpt_oss_mxfp4, native_gemms):
    """Prefills of one and two tokens alone and among others: an expert's single prefill row takes the native bf16
    GEMM's tiles as its rows among others do; equal tokens and logprobs, bitwise."""
    if cpu.mxfp4_gemv() is None or not native_gemms.dequantizing_gemm_available():
        pytest.skip('large steps take the native bf16 GEMM with AVX512-BF16 and without AMX')
    engine = engine_of(wide_gpt_oss_mxfp4)
    try:
        assert_batch_invariant(engine, random_prompts([1, 2, 1, 1, 2, 1, 9], seed=7))
    finally:
        engine.close()


@pytest.fixture(scope='module', params=['qwen3_moe', 'mixtral'])
def gguf_moe(request, tmp_path_factory) -> str:
    """A tiny GGUF MoE file's experts as blocks (``test_gguf_moe.FILES``): Qwen3-MoE's Q4_K gate and up beside a
    Q6_K and a Q8_0 down, Mixtral's beside a Q5_K down."""
    return served_mixed_gguf(request.param, tmp_path_factory.mktemp(f'gguf_{request.param}'),
                             GGUF_MOE_FILES[request.param][0])


@pytest.mark.parametrize('decoder', ['stack', 'layers'])
def test_k_quant_experts_choose_by_the_kind_of_rows(gguf_moe, decoder, native_gemms, monkeypatch):
    """GGUF K-quant experts (4 experts, top-2) in bf16, the GEMVs' bound held to 2 rows: 8 prompts decoding together
    give an expert more rows than the bound, which ran on the dequantized weight; prefills of one and two tokens
    gave shares that ran on the GEMV."""
    if None in (cpu.int4_gemv(), cpu.q5k_gemv(), cpu.q6k_gemv(), cpu.q8_gemv()):
        pytest.skip('the native K-quant GEMVs need AVX512-BF16')
    for kind in GEMV_MAX_ROWS:
        monkeypatch.setitem(GEMV_MAX_ROWS, kind, (2, 2))
    engine = engine_of(gguf_moe, decoder=decoder)
    try:
        assert_batch_invariant(engine, random_prompts([1, 2, 3, 5, 8, 13, 21, 34], seed=6, vocab=250))
    finally:
        engine.close()


def test_fp32_router_rows_do_not_depend_on_their_number(native):
    """An fp32 router (``Fp32Router``, its packed copy on ``fp32_packed_linear``) of bf16 rows: each row's logits
    bitwise the same alone and among others, for 37 experts (a partial tile); within fp32 rounding of torch's."""
    if cpu.fp32_gemm() is None:
        pytest.skip('fp32_packed_linear needs AVX-512')
    g = torch.Generator().manual_seed(0)
    router = Fp32Router(301, 37)
    weight = torch.randn(37, 301, generator=g)
    router.weight = torch.nn.Parameter(weight, requires_grad=False)
    router.finalize()
    assert router.kernel is not None and router.weight is None
    x = torch.randn(23, 301, generator=g).bfloat16()
    together = router(x)
    torch.testing.assert_close(together, F.linear(x.float(), weight), rtol=1e-5, atol=1e-4)
    assert all(torch.equal(together[i:i + 1], router(x[i:i + 1])) for i in range(23))
    assert torch.equal(together[5:12], router(x[5:12]))


@pytest.mark.parametrize('outputs', [8, 1])
def test_bf16_router_rows_do_not_depend_on_their_number(outputs, native_gemms):
    """A bf16 router of 8 experts (Mixtral's) and a one-output gate (Qwen2-MoE's shared-expert gate), hidden 2048,
    their outputs off the native GEMM's 16-row panels: each of 2048 rows the same bits alone and among others
    (oneDNN's GEMM, which ran them before, gave a few of the router's rows other bits in calls of more than 128
    rows); the native stack's projection gives the layer's bits on the layer's own panels."""
    torch.manual_seed(0)
    layer = Linear(2048, outputs, bias=True).bfloat16()
    torch.nn.init.normal_(layer.weight, std=0.2)
    torch.nn.init.normal_(layer.bias)
    layer.finalize(LinearOptions(pack_cpu=True))
    x = torch.randn(2048, 2048).bfloat16()
    together = layer(x)
    assert together.shape == (2048, outputs)
    assert all(torch.equal(together[i:i + 1], layer(x[i:i + 1])) for i in range(x.shape[0]))
    assert isinstance(layer.kernel, NativeBf16Kernel) and layer.kernel.out_features == outputs
    projection = layer.kernel.router_projection(layer.bias)
    assert projection.weight.data_ptr() == layer.kernel.panels.data_ptr() and projection.outputs == outputs
    assert torch.equal(projection(x=x), together)


@pytest.fixture(scope='module', params=['mixtral', 'qwen2_moe'])
def wide_moe(request, tmp_path_factory) -> str:
    """Mixtral and Qwen2-MoE (its shared expert gated by one output) with 8 experts at hidden 2048, where oneDNN's
    GEMM gave a router's rows in calls of more than 128 other bits than alone."""
    experts = dict(num_local_experts=8) if request.param == 'mixtral' else dict(num_experts=8)
    return save_tiny_model(request.param, str(tmp_path_factory.mktemp(f'{request.param}_wide')), hidden_size=2048,
                           head_dim=16, **experts)


@pytest.mark.parametrize('decoder', ['stack', 'layers'])
def test_bf16_routers_off_the_panels_are_batch_invariant(wide_moe, decoder, native_gemms):
    """The routers (8 experts) and the shared-expert gate (one output) on the native GEMM, their panels padded, in
    the native stack and in the layers' forward: prefills of up to 207 rows together, each prompt alone."""
    engine = engine_of(wide_moe, decoder=decoder)
    try:
        blocks = [module for module in engine.runner.model.modules() if isinstance(module, SparseMoeBlock)]
        gates = [block.gate for block in blocks] + [block.shared_expert_gate for block in blocks
                                                    if block.shared_expert_gate is not None]
        assert blocks and all(isinstance(gate.kernel, NativeBf16Kernel) and gate.out_features % 16 for gate in gates)
        assert (engine.runner.model.native_stack is not None) == (decoder == 'stack')
        assert_batch_invariant(engine, random_prompts([1, 2, 5, 40, 90, 7, 60, 3], seed=5, vocab=300))
    finally:
        engine.close()


def test_an_fp32_router_is_packed_once(deepseek_v3, native_gemms):
    """DeepSeek-V3's fp32 routers in a bf16 model: the packed tiles are each router's one copy, the weight released
    after packing and the native stack's projection on the Python kernel's tiles (it packed its own before)."""
    if cpu.fp32_gemm() is None:
        pytest.skip('fp32_packed_linear needs AVX-512')
    engine = engine_of(deepseek_v3)
    try:
        assert engine.runner.model.native_stack is not None
        routers = [module for module in engine.runner.model.modules() if isinstance(module, Fp32Router)]
        assert routers and all(router.weight is None for router in routers)
        for router in routers:
            projection = router.native_projection()
            assert projection.weight.data_ptr() == router.kernel.packed.data_ptr()
            assert projection.outputs == router.kernel.out_features
    finally:
        engine.close()
