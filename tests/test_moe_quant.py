"""Mixture-of-experts checkpoints with 4-bit experts (AWQ, GPTQ with and without act-order), served with the
experts held in 4 bits: the engine on quantized tiny MoE models against transformers running the weights
AutoAWQ's and AutoGPTQ's own code read back from the same checkpoint, the CPU int4 expert kernels, and the
Triton fused MoE on 4-bit experts against the torch reference."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import save_tiny_model
from helpers import assert_transformers_greedy, fp32_kernel, make_engine, random_prompts, run
from quant_models import quantize_checkpoint
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu, moe
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import LinearOptions, use_weight_format, weight_format_for
from lmdeploy.pytorch.nn.quant.dense import DenseKernel
from lmdeploy.pytorch.nn.quant.int4_cpu import NativeInt4Kernel, TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.w4a16 import PerExpertKernel

GREEDY_8 = GenerationConfig(max_new_tokens=8, ignore_eos=True)
GREEDY_16 = GenerationConfig(max_new_tokens=16, ignore_eos=True)
# sizes in groups of 128 (64 for act-order), so that every projection has several groups
MOE_SIZES = {
    'qwen3_moe': dict(hidden_size=256, head_dim=64, intermediate_size=256, moe_intermediate_size=256, num_experts=8),
    'mixtral': dict(hidden_size=256, head_dim=64, intermediate_size=256, num_local_experts=4),
    'qwen2_moe': dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, num_experts=8),
}
CASES = [('qwen3_moe', 'awq', 128, False), ('qwen3_moe', 'gptq', 64, True), ('mixtral', 'awq', 128, False),
         ('qwen2_moe', 'gptq', 128, False)]


def quantized_moe(root: str, kind: str, method: str, group_size: int, desc_act: bool) -> tuple[str, str]:
    """A tiny random ``kind`` quantized with ``method``, and a dense fp32 copy holding the weights that
    AutoAWQ's or AutoGPTQ's own unpacker reads back from it (for transformers)."""
    src = save_tiny_model(kind, os.path.join(root, 'float'), **MOE_SIZES[kind])
    path = quantize_checkpoint(src, os.path.join(root, method), method, group_size, desc_act)
    dense = os.path.join(root, 'dequantized')
    shutil.copytree(src, dense)
    state = load_file(os.path.join(src, 'model.safetensors'))
    state.update(load_file(os.path.join(path, 'dequantized.safetensors')))
    save_file(state, os.path.join(dense, 'model.safetensors'), metadata={'format': 'pt'})
    return path, dense


def experts_of(engine: Engine) -> list[FusedExperts]:
    return [module for module in engine.runner.model.modules() if isinstance(module, FusedExperts)]


@pytest.mark.parametrize('kind,method,group_size,desc_act', CASES)
def test_engine_matches_transformers_on_the_dequantized_experts(tmp_path, kind, method, group_size, desc_act):
    """fp32 greedy tokens equal transformers' on the independently unpacked weights, batched and solo; the
    experts stay packed after load and the routers dense."""
    path, dense = quantized_moe(str(tmp_path), kind, method, group_size, desc_act)
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    prompts = random_prompts([6, 27, 13], seed=5)
    engine = make_engine(path)
    try:
        hidden, inter = hf.config.hidden_size, getattr(hf.config, 'moe_intermediate_size', hf.config.intermediate_size)
        for experts in experts_of(engine):
            e = experts.num_experts
            shapes = ({'gate_up_qweight': (e, hidden, 2 * inter // 8), 'down_qweight': (e, inter, hidden // 8)}
                      if method == 'awq' else
                      {'gate_up_qweight': (e, hidden // 8, 2 * inter), 'down_qweight': (e, inter // 8, hidden)})
            for name, shape in shapes.items():
                assert getattr(experts, name).dtype == torch.int32 and getattr(experts, name).shape == shape
            floats = {name for name, param in experts.named_parameters() if param.is_floating_point()}
            assert floats == {'gate_up_scales', 'down_scales'}  # no dense copy of the experts
            assert (getattr(experts, 'gate_up_g_idx', None) is not None) == desc_act
        mlps = [layer.mlp for layer in engine.runner.model.layers if hasattr(layer.mlp, 'experts')]
        assert all(isinstance(mlp.gate.kernel, fp32_kernel(DenseKernel)) for mlp in mlps)  # fp32 and dense
        batched = run(engine, prompts, GREEDY_16)
        solo = run(engine, prompts[1:2], GREEDY_16)
    finally:
        engine.close()
    assert solo[0] == batched[1]
    assert_transformers_greedy(hf, prompts, batched, 16)


@pytest.mark.parametrize('method', ['awq', 'gptq'])
def test_tp2_matches_tp1(tmp_path, method):
    """Each rank holds every expert's share of the packed gate/up outputs and of the down inputs (whole
    groups)."""
    path, _ = quantized_moe(str(tmp_path), 'qwen3_moe', method, 128, False)
    prompts = random_prompts([5, 17], seed=3)
    outs = {}
    for tp in (1, 2):
        engine = make_engine(path, tp=tp)
        try:
            outs[tp] = run(engine, prompts, GREEDY_8)
        finally:
            engine.close()
    assert outs[1] == outs[2]


def test_bf16_experts_run_on_the_int4_cpu_kernel(tmp_path):
    """In bf16 on the CPU each expert's projections run on the int4 kernel of its own grid (the checkpoint's
    packed tensors are not kept beside it, and nothing in bf16); the logits stay within bf16 rounding of the
    bf16 engine's on the dequantized weights."""
    path, dense = quantized_moe(str(tmp_path), 'qwen3_moe', 'gptq', 64, True)
    prompt = random_prompts([19], seed=3)[0]
    logits = {}
    for model in (path, dense):
        engine = Engine(model, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                        show_progress=False)
        try:
            for experts in experts_of(engine) if model == path else ():
                assert isinstance(experts.kernel, PerExpertKernel)
                assert all(isinstance(experts.kernel.kernel(proj, e), (NativeInt4Kernel, TorchInt4Kernel))
                           for proj in ('gate_up', 'down') for e in range(experts.num_experts))
                assert experts.gate_up_qweight is None and not any(True for _ in experts.parameters())
            outs = run(engine, [prompt, prompt[:7]], GREEDY_8)
            assert [len(out) for out in outs] == [8, 8]
            logits[model] = engine.get_logits(prompt).float()
        finally:
            engine.close()
    error = (logits[path] - logits[dense]).norm() / logits[dense].norm()
    assert error < 0.02, error


def random_experts(config: dict, num_experts: int, hidden: int, inter: int) -> FusedExperts:
    """Experts of ``config``'s format with random codes, zero points (1-15), scales and ``g_idx``."""
    with use_weight_format(weight_format_for(config)):
        experts = FusedExperts(hidden, inter, num_experts)
    g = torch.Generator().manual_seed(0)
    for name, param in experts.named_parameters():
        if name.endswith('g_idx'):
            inputs = param.shape[-1]
            param.copy_(torch.stack([torch.randperm(inputs, generator=g) % (inputs // config['group_size'])
                                     for _ in range(num_experts)]))
        elif name.endswith('qzeros'):
            param.copy_(torch.randint(0, 2**31 - 1, param.shape, generator=g) & 0x77777777)  # fields 0-7: zeros 1-8
        elif param.dtype == torch.int32:
            param.copy_(torch.randint(-2**31, 2**31 - 1, param.shape, generator=g, dtype=torch.int64))
        else:
            param.copy_(torch.rand(param.shape, generator=g) * 0.02 + 0.005)
    return experts


def dense_weights(experts: FusedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` unpacked by the format, in fp32."""
    return tuple(torch.stack([experts.weight_format.dequantize(experts.projection(proj, e))
                              for e in range(experts.num_experts)]) for proj in ('gate_up', 'down'))


FORMATS = [{'quant_method': 'awq', 'bits': 4, 'zero_point': True, 'version': 'gemm', 'group_size': 32},
           {'quant_method': 'gptq', 'bits': 4, 'sym': False, 'group_size': 32, 'desc_act': True}]


@pytest.mark.parametrize('config', FORMATS, ids=['awq', 'gptq-act-order'])
def test_per_expert_reference_matches_dense_fused_moe(config):
    """The fp32 path (each routed expert unpacked on its call) equals the dense fused MoE on the unpacked
    weights."""
    experts = random_experts(config, 4, 64, 32)
    gate_up, down = dense_weights(experts)
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    weights, ids = moe.moe_routing(torch.randn(9, 4, generator=torch.Generator().manual_seed(2)), 2, True)
    torch.testing.assert_close(experts(hidden, weights, ids), moe.fused_moe(hidden, gate_up, down, weights, ids))


@pytest.mark.triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('config', FORMATS + [{**FORMATS[0], 'group_size': 64}],
                         ids=['awq', 'gptq-act-order', 'awq-g64'])
@pytest.mark.parametrize('num_tokens', [1, 21])
def test_triton_fused_moe_on_int4_experts(dtype, config, num_tokens):
    """The Triton fused MoE dequantizing the 4-bit tiles in registers against the torch fused MoE on the
    unpacked weights; hidden size twice the group (at 21 tokens, group 64: K tiles of 64, one group each)."""
    from kernel_env import DEVICE

    from lmdeploy.pytorch.nn.quant.w4a16_cuda import TritonInt4ExpertKernel
    hidden_size = 2 * config['group_size']
    experts = random_experts(config, 4, hidden_size, hidden_size // 2)
    gate_up, down = dense_weights(experts)
    kernel = TritonInt4ExpertKernel.of(experts.weight_format, experts)
    kernel.gate_up, kernel.down = (type(w)(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in w))
                                   for w in (kernel.gate_up, kernel.down))
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=g)
    weights, ids = moe.moe_routing(torch.randn(num_tokens, 4, generator=g), 2, True)
    out = kernel(hidden.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE), None, None, None)
    expected = moe.fused_moe(hidden, gate_up, down, weights, ids)
    tolerance = 1e-2 if dtype != torch.float32 else 2e-3 if DEVICE == 'cuda' else 1e-4
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize('config', FORMATS, ids=['awq', 'gptq-act-order'])
def test_bf16_cpu_expert_kernels_match_the_unpacked_weights(config):
    """bf16 experts on the CPU (the native int4 GEMV where built, gate-and-up with its SiLU epilogue; torch's int4
    kernel otherwise) give the fused MoE on the unpacked weights, up to bf16 rounding."""
    experts = random_experts(config, 4, 64, 32)
    gate_up, down = dense_weights(experts)
    experts.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
    kernels = [experts.kernel.kernel(proj, e) for proj in ('gate_up', 'down') for e in range(4)]
    expected_kind = NativeInt4Kernel if cpu.int4_gemv() is not None else TorchInt4Kernel
    assert all(isinstance(kernel, expected_kind) for kernel in kernels)
    g = torch.Generator().manual_seed(3)
    for tokens in (1, 3, 40):
        hidden = torch.randn(tokens, 64, generator=g)
        weights, ids = moe.moe_routing(torch.randn(tokens, 4, generator=g), 2, True)
        expected = moe.fused_moe(hidden, gate_up, down, weights, ids)
        out = experts(hidden.bfloat16(), weights, ids).float()
        assert (out - expected).norm() / expected.norm() < 1e-2


def test_a_missing_expert_tensor_fails_the_load(tmp_path):
    """Each expert's packed tensors are required: one expert's ``qzeros`` dropped is named at load."""
    path, _ = quantized_moe(str(tmp_path), 'qwen3_moe', 'awq', 128, False)
    tensors = load_file(f'{path}/model.safetensors')
    del tensors['model.layers.1.mlp.experts.5.up_proj.qzeros']
    save_file(tensors, f'{path}/model.safetensors', metadata={'format': 'pt'})
    with pytest.raises(ValueError, match='weights are missing') as info:
        make_engine(path)
    assert 'layers.1.mlp.experts.gate_up_qzeros (expert 5 up)' in str(info.value)
    assert '(1 in all)' in str(info.value)


def test_formats_without_expert_kernels_refuse_moe_layers():
    with use_weight_format(weight_format_for({'quant_method': 'smooth_quant'})):
        with pytest.raises(ValueError, match='mixture-of-experts layers of W8A8Format'):
            FusedExperts(64, 32, 4)
