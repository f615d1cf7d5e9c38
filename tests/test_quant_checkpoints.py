"""AWQ and GPTQ checkpoints served as they are: the unpacking against AutoAWQ's and AutoGPTQ's own
(independent) code, the CPU int4 kernel and the Triton W4A16 GEMM against the unpacked weights, and
the engine on quantized tiny Llamas against transformers running the independently dequantized weights."""
from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from quant_models import (awq_dequantized, awq_reference, awq_tensors, gptq_dequantized, gptq_layer, gptq_tensors,
                          quantize_checkpoint, random_grid)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant import LinearOptions, use_weight_format, weight_format_for
from lmdeploy.pytorch.nn.quant.int4_cpu import NativeInt4Kernel, TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.w4a16 import ReferenceKernel

AWQ = {'quant_method': 'awq', 'bits': 4, 'zero_point': True, 'version': 'gemm'}
GPTQ = {'quant_method': 'gptq', 'bits': 4, 'sym': False}
GREEDY_8 = GenerationConfig(max_new_tokens=8, ignore_eos=True)


def loaded_layer(config: dict, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> Linear:
    """A linear layer of ``config``'s format filled with a checkpoint's ``tensors``."""
    out_features = tensors['scales'].shape[1]
    in_features = tensors['qzeros'].shape[0] * config['group_size']
    with use_weight_format(weight_format_for(config)):
        layer = Linear(in_features, out_features)
    for name, param in layer.named_parameters():
        if not getattr(param, 'keep_dtype', False):
            param.data = param.data.to(dtype)
        param.data.copy_(tensors[name])
    return layer


def dequantized(layer: Linear) -> torch.Tensor:
    return layer.weight_format.unpack(layer).dequantize(torch.float32)


@pytest.mark.parametrize('group_size', [128, 64, 32])
def test_awq_unpacking_matches_autoawq(group_size):
    tensors = awq_tensors(*random_grid(64, 256, group_size, seed=group_size), group_size)
    layer = loaded_layer({**AWQ, 'group_size': group_size}, tensors)
    expected = awq_dequantized(tensors, group_size)
    assert torch.equal(dequantized(layer), expected)
    x = torch.randn(3, 256)
    assert isinstance(layer.kernel, ReferenceKernel)
    torch.testing.assert_close(layer(x), x @ expected.T)


@pytest.mark.parametrize('desc_act', [False, True])
@pytest.mark.parametrize('group_size', [128, 32])
def test_gptq_unpacking_matches_autogptq(group_size, desc_act):
    """AutoGPTQ packs (zero points stored minus one) and dequantizes with its own torch code."""
    codes, zeros, scales = random_grid(64, 256, group_size, seed=group_size, min_zero=1)
    g_idx = torch.randperm(256, generator=torch.Generator().manual_seed(1)) // group_size if desc_act else None
    reference = gptq_layer(codes, zeros, scales, group_size, g_idx)
    layer = loaded_layer({**GPTQ, 'group_size': group_size, 'desc_act': desc_act}, gptq_tensors(reference))
    assert torch.equal(dequantized(layer), gptq_dequantized(reference))


def test_gptq_unpacking_of_autoawqs_conversion():
    """AutoAWQ's AWQ-to-GPTQ conversion (``unpack_reorder_pack``, for the exllama kernels) read as GPTQ
    gives AutoAWQ's dequantized AWQ weight (zero points from 1: the format stores them minus one)."""
    tensors = awq_tensors(*random_grid(64, 256, 128, seed=5, min_zero=1), 128)
    qweight, qzeros = awq_reference().unpack_reorder_pack(tensors['qweight'], tensors['qzeros'], 4)
    layer = loaded_layer({**GPTQ, 'group_size': 128}, {'qweight': qweight, 'qzeros': qzeros,
                                                        'scales': tensors['scales']})
    assert torch.equal(dequantized(layer), awq_dequantized(tensors, 128))


@pytest.mark.parametrize('config', [{**AWQ, 'bits': 8}, {**AWQ, 'version': 'gemv'}, {**GPTQ, 'bits': 3},
                                    {**GPTQ, 'checkpoint_format': 'marlin'}])
def test_unsupported_variants_are_refused(config):
    with pytest.raises(ValueError, match='supported'):
        weight_format_for(config)


def cpu_layers(dtype) -> list[tuple[Linear, torch.Tensor]]:
    """An AWQ and an act-order GPTQ layer (scales in ``dtype``) with their fp32 weights."""
    awq = awq_tensors(*random_grid(96, 256, 128, seed=7), 128)
    awq_layer = loaded_layer({**AWQ, 'group_size': 128}, awq, dtype)
    codes, zeros, scales = random_grid(96, 256, 64, seed=8, min_zero=1)
    g_idx = torch.randperm(256, generator=torch.Generator().manual_seed(2)) // 64
    gptq_layer_ = loaded_layer({**GPTQ, 'group_size': 64, 'desc_act': True},
                               gptq_tensors(gptq_layer(codes, zeros, scales, 64, g_idx)), dtype)
    return [(layer, dequantized(layer)) for layer in (awq_layer, gptq_layer_)]


@pytest.mark.parametrize('rows', [1, 5, 8, 9, 40])
def test_int4_cpu_kernel_runs_the_checkpoint_grid(rows):
    """With bf16 scales, the native int4 GEMV (where built; else torch's int4 kernel) gives ``x @ W.T`` up to
    bf16 rounding (torch's kernel rounds
    ``(8 - zero) * scale`` to bf16)."""
    for layer, weight in cpu_layers(torch.bfloat16):
        layer.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
        assert isinstance(layer.kernel, NativeInt4Kernel if cpu.int4_gemv() else TorchInt4Kernel)
        assert layer.qweight is None
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        expected = x.float() @ weight.T
        error = (layer(x).float() - expected).norm() / expected.norm()
        assert error < 1e-2, error


def test_a_group_size_torchs_int4_kernel_refuses_keeps_the_reference_kernel_in_bf16():
    """torch's int4 CPU kernel takes groups of 32 to 256 only: an AWQ checkpoint of groups of 16 runs unpacked."""
    layer = loaded_layer({**AWQ, 'group_size': 16}, awq_tensors(*random_grid(64, 256, 16, seed=3), 16),
                         torch.bfloat16)
    weight = dequantized(layer)
    layer.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
    assert isinstance(layer.kernel, ReferenceKernel)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    expected = x.float() @ weight.T
    assert (layer(x).float() - expected).norm() / expected.norm() < 1e-2


def test_fp32_models_keep_the_reference_kernel():
    for layer, _ in cpu_layers(torch.float32):
        layer.finalize(LinearOptions(pack_cpu=True, dtype=torch.float32))
        assert isinstance(layer.kernel, ReferenceKernel)


@pytest.mark.triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('rows', [1, 19])
def test_triton_w4a16_matches_the_reference(dtype, rows):
    from kernel_env import DEVICE

    from lmdeploy.pytorch.nn.quant.w4a16_cuda import TritonW4A16Kernel
    for layer, weight in cpu_layers(dtype):
        kernel = TritonW4A16Kernel.of(layer.weight_format.unpack(layer))
        for name in ('qweight', 'scales', 'offsets'):
            setattr(kernel, name, getattr(kernel, name).to(DEVICE))
        if kernel.order is not None:
            kernel.order = kernel.order.to(DEVICE)
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
        expected = x.float() @ weight.T.to(DEVICE)
        tolerance = 1e-2 if dtype != torch.float32 else 2e-3 if DEVICE == 'cuda' else 1e-4  # tf32 dots on CUDA
        torch.testing.assert_close(kernel(x, None).float(), expected, rtol=tolerance, atol=tolerance)


QUANT_LLAMA = dict(hidden_size=256, intermediate_size=512, head_dim=64)


@pytest.fixture(scope='module')
def float_llama(tmp_path_factory) -> str:
    return save_tiny_model('llama', str(tmp_path_factory.mktemp('float_llama')), **QUANT_LLAMA)


@pytest.mark.parametrize('method,desc_act', [('awq', False), ('gptq', False), ('gptq', True)])
def test_engine_matches_transformers_on_the_dequantized_weights(float_llama, tmp_path, method, desc_act):
    """Loaded with no flag; fp32 greedy tokens equal transformers' with the weights the independent
    unpacker reads from the same checkpoint."""
    path = quantize_checkpoint(float_llama, str(tmp_path / method), method, 128, desc_act)
    hf = AutoModelForCausalLM.from_pretrained(float_llama, dtype=torch.float32).eval()
    hf.load_state_dict(load_file(f'{path}/dequantized.safetensors'), strict=False)
    prompts = random_prompts([4, 23], seed=11)
    engine = make_engine(path)
    try:
        on_cuda = engine.config.device.startswith('cuda')
        if on_cuda:  # gpu_check.sh runs this test on CUDA
            from lmdeploy.pytorch.nn.quant.w4a16_cuda import TritonW4A16Kernel
        kernel = TritonW4A16Kernel if on_cuda else ReferenceKernel
        assert isinstance(engine.runner.model.layers[0].mlp.gate_up_proj.kernel, kernel)
        outs = run(engine, prompts)
    finally:
        engine.close()
    assert_transformers_greedy(hf, prompts, outs)


@pytest.mark.parametrize('method', ['awq', 'gptq'])
def test_tp2_matches_tp1(float_llama, tmp_path, method):
    """q/k/v and gate/up slice the packed outputs, o_proj and down_proj the packed inputs and groups."""
    path = quantize_checkpoint(float_llama, str(tmp_path / method), method, 128)
    prompts = random_prompts([5, 17], seed=3)
    outs = {}
    for tp in (1, 2):
        engine = make_engine(path, tp=tp)
        try:
            outs[tp] = run(engine, prompts)
        finally:
            engine.close()
    assert outs[1] == outs[2]


def test_bf16_engine_runs_the_int4_kernel(float_llama, tmp_path):
    """In bf16 every projection of an act-order GPTQ checkpoint runs on the int4 CPU kernel; the logits
    stay within bf16 rounding of fp32's."""
    path = quantize_checkpoint(float_llama, str(tmp_path / 'gptq'), 'gptq', 128, desc_act=True)
    prompt = random_prompts([21], seed=8)[0]
    logits = {}
    for dtype in ('float32', 'bfloat16'):
        engine = Engine(path, PytorchEngineConfig(dtype=dtype, num_gpu_blocks=64, block_size=16), show_progress=False)
        try:
            kinds = {type(module.kernel) for module in engine.runner.model.modules() if isinstance(module, Linear)}
            bf16_kind = NativeInt4Kernel if cpu.int4_gemv() else TorchInt4Kernel
            assert kinds == {bf16_kind if dtype == 'bfloat16' else ReferenceKernel}
            assert len(run(engine, [prompt, prompt[:5]], GREEDY_8)[1]) == 8
            logits[dtype] = engine.get_logits(prompt).float()
        finally:
            engine.close()
    error = (logits['bfloat16'] - logits['float32']).norm() / logits['float32'].norm()
    assert error < 0.05, error
