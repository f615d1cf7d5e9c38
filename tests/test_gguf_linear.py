"""GGUF Q4_K, Q6_K and Q8_0 projections served as their blocks (files of one type; mixed files in
``test_gguf_mixed.py``): unpacked against the ``gguf`` package's own dequantization, and the engine against
transformers loading the same GGUF file."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from family_checks import assert_tp2_equals_tp1
from helpers import (assert_transformers_greedy, dequantized_weight, fp32_kernel, large_step_reference, make_engine,
                     random_prompts, run)
from test_gguf import _encode, make_gguf
from transformers import AutoModelForCausalLM

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.distributed.parallel_state import TPGroup, use_group
from lmdeploy.pytorch.nn.linear import GateUpLinear, Linear, RowLinear
from lmdeploy.pytorch.nn.quant import LinearOptions, use_weight_format
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.gguf import GgufFileFormat, GgufFormat
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel, TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.q6k_cpu import GEMV_MAX_ROWS
from lmdeploy.pytorch.weights.gguf import convert_gguf


def gguf_layer(qtype: Q, out_features: int = 48, in_features: int = 512, seed: int = 0):
    """A linear layer holding random ``qtype`` blocks, and ``gguf``'s dequantization of them."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.1
    data = _encode(weight, qtype, rng)
    with use_weight_format(GgufFormat(qtype.name)):
        layer = Linear(in_features, out_features)
    layer.qweight.copy_(torch.from_numpy(data).view(layer.qweight.shape))
    return layer, torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))


def q4_k_cpu_kernel() -> type:
    """What runs a Q4_K layer in bf16 on this CPU: small steps on the native Q4_K GEMV and larger ones dequantized
    from its copy where it is built, else torch's int4 kernel."""
    return TorchInt4Kernel if cpu.int4_gemv() is None else SmallStepInt4Kernel


@pytest.mark.parametrize('qtype', [Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_unpacking_matches_gguf(qtype):
    layer, expected = gguf_layer(qtype)
    assert torch.equal(layer.weight_format.dequantize(layer), expected)
    x = torch.randn(3, 512)
    torch.testing.assert_close(layer(x), x @ expected.T)


@pytest.mark.parametrize('qtype,kernel,dtype,tolerance', [(Q.Q8_0, fp32_kernel, torch.float32, 1e-6),
                                                          (Q.Q4_K, q4_k_cpu_kernel, torch.bfloat16, 1e-2),
                                                          (Q.Q4_K, fp32_kernel, torch.float32, 1e-6),
                                                          (Q.Q6_K, fp32_kernel, torch.float32, 1e-6)])
def test_loaded_kernels(qtype, kernel, dtype, tolerance):
    """Q4_K on the native Q4_K GEMV (up to ``gemv_max_rows('q4k')`` rows; dequantized above) is the file's weights
    (its bf16 results rounded); on torch's int4 kernel (where the GEMV is not built) exact up to the rounding of
    ``d * sc`` and ``dmin * m`` to bf16. fp32 dequantizes the blocks once at load: gguf's weights exactly (packed for
    the fixed-order fp32 GEMM where it is built)."""
    layer, expected = gguf_layer(qtype, seed=3)
    kernel = kernel()
    layer.finalize(LinearOptions(pack_cpu=True, dtype=dtype))
    assert isinstance(layer.kernel, kernel) and layer.qweight is None
    if dtype == torch.float32:
        assert torch.equal(dequantized_weight(layer.kernel), expected)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 512).to(dtype)
        reference = x.float() @ expected.T
        error = (layer(x).float() - reference).norm() / reference.norm()
        assert error < tolerance, (rows, error)


@pytest.mark.parametrize('amx', [True, False])
def test_q8_0_native_kernel_on_both_paths(amx, monkeypatch):
    """bf16 on the CPU: Q8_0 on the native 8-bit GEMV up to ``gemv_max_rows('q8_0')`` tokens (chosen at load, by
    AMX or not), dequantized from the same copy for ``F.linear`` above; both against gguf's dequantization, the
    large step exactly ``F.linear`` of its weights in bf16."""
    if cpu.q8_gemv() is None:
        pytest.skip('the native 8-bit GEMV was not built for this CPU')
    monkeypatch.setattr(cpu, 'onednn_amx', lambda: amx)
    layer, expected = gguf_layer(Q.Q8_0, seed=5)
    layer.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
    kernel = layer.kernel
    assert isinstance(kernel, SmallStepInt4Kernel) and isinstance(kernel.small, Q8_0Gemv) and layer.qweight is None
    bound = kernel.small_step_rows
    assert bound == GEMV_MAX_ROWS['q8_0'][0 if amx else 1]
    bias = torch.randn(48).bfloat16()
    for rows in (1, 5, bound, bound + 1):
        x = torch.randn(rows, 512).bfloat16()
        reference = x.float() @ expected.T + bias.float()
        out = layer.kernel(x, bias)
        assert out.dtype == torch.bfloat16
        error = (out.float() - reference).norm() / reference.norm()
        assert error < 1e-2, (rows, error)
        gemv = cpu.native().q8_linear(x, kernel.small.packed, kernel.small.scales).bfloat16() + bias
        dequantized = large_step_reference(x, expected.bfloat16(), bias)
        assert torch.equal(out, gemv if rows <= bound else dequantized), rows


@pytest.mark.parametrize('qtype', [Q.Q8_0, Q.Q4_K])
def test_engine_matches_transformers_on_the_gguf_file(tmp_path: Path, qtype):
    """A llama whose projections are all ``qtype`` (q/k rows permuted by llama.cpp): the converted folder
    keeps their blocks, and fp32 greedy tokens equal transformers' from the GGUF file."""
    src = tmp_path / 'tiny.gguf'
    make_gguf(src, 'llama', head_dim=64, hidden=256, projections=qtype)
    out = tmp_path / 'hf'
    convert_gguf(str(src), str(out))
    config = json.loads((out / 'config.json').read_text())
    layers = [f'layers.{i}.{name}' for i in range(2) for name in ('self_attn.qkv_proj', 'self_attn.o_proj',
                                                                   'mlp.gate_up_proj', 'mlp.down_proj')]
    assert config['quantization_config'] == {'quant_method': 'gguf', 'ggml_types': dict.fromkeys(layers, qtype.name)}
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=src.name, dtype=torch.float32).eval()
    prompts = random_prompts([6, 19], seed=4, vocab=200)
    engine = make_engine(str(out))
    try:
        outs = run(engine, prompts)
    finally:
        engine.close()
    assert_transformers_greedy(reference, prompts, outs)


def test_bf16_engine_runs_q4_k_on_the_int4_kernel(tmp_path: Path):
    """bf16 on the CPU: Q4_K layers on the native int4 GEMV (torch's int4 kernel where it is not built), within
    5% of fp32's logits."""
    src = tmp_path / 'tiny.gguf'
    make_gguf(src, 'llama', head_dim=64, hidden=256, projections=Q.Q4_K)
    convert_gguf(str(src), str(tmp_path / 'hf'))
    prompt = random_prompts([13], seed=2, vocab=200)[0]
    logits = {}
    for dtype in ('float32', 'bfloat16'):
        engine = Engine(str(tmp_path / 'hf'), PytorchEngineConfig(dtype=dtype, num_gpu_blocks=64, block_size=16),
                        show_progress=False)
        try:
            kinds = {type(module.kernel) for module in engine.runner.model.modules() if isinstance(module, Linear)}
            assert kinds == {q4_k_cpu_kernel() if dtype == 'bfloat16' else fp32_kernel()}
            logits[dtype] = engine.get_logits(prompt).float()
        finally:
            engine.close()
    error = (logits['bfloat16'] - logits['float32']).norm() / logits['float32'].norm()
    assert error < 0.05, error


@pytest.mark.parametrize('qtype, ffn', [(Q.Q8_0, 512), (Q.Q4_K, 768)])
def test_tp2_matches_tp1(tmp_path: Path, qtype, ffn):
    """Row-parallel layers split their blocks along the inputs, merged ones their rows (Q4_K's 768 intermediate
    features as 512 and 256: whole blocks)."""
    src = tmp_path / 'tiny.gguf'
    make_gguf(src, 'llama', head_dim=128, hidden=512, ffn=ffn, projections=qtype)
    convert_gguf(str(src), str(tmp_path / 'hf'))
    prompts = random_prompts([5, 17], seed=3, vocab=200)
    assert_tp2_equals_tp1(str(tmp_path / 'hf'), prompts)


@pytest.mark.parametrize('rank, share', [(0, (0, 512)), (1, (512, 768))])
def test_mlp_shares_are_whole_blocks(rank, share):
    """Under tensor parallelism an MLP deals out its intermediate features in whole blocks of the file's types
    (768 over 2 ranks as 512 and 256; Llama-2-7B's 11,008 as 22 and 21 blocks of 256), so its down projection
    keeps its Q4_K blocks on both ranks instead of holding them dequantized."""
    weight_format = GgufFileFormat({'layers.0.mlp.gate_up_proj': 'Q4_K', 'layers.0.mlp.down_proj': 'Q4_K'})
    with use_group(TPGroup(rank, 2)), use_weight_format(weight_format):
        gate_up = GateUpLinear(256, 768)
        down = RowLinear.after(gate_up, 256)
    assert gate_up.ranges == [share, share] and down.in_range == share
    assert isinstance(weight_format.layer_format('layers.0.mlp.down_proj', down), GgufFormat)
    assert not weight_format.dequantized
