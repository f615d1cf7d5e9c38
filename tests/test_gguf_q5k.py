"""GGUF Q5_K projections kept as their blocks (Q5_K_M files; Qwen3.5's Q4_K_M ``attn_qkv``): unpacked and retiled
exactly as the ``gguf`` package dequantizes them, the native Q5_K GEMV on them in bf16, and a tiny Q5_K_M-like
Llama (Q5_K, some Q6_K) served from its blocks with transformers' fp32 greedy tokens, and in bf16 in the native
decoder stack, equal to its layers, holding only the file's blocks."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from helpers import (assert_transformers_greedy, dequantized_weight, fp32_kernel, large_step_reference, make_engine,
                     random_prompts, run)
from test_decoder_stack import check_every_step
from test_gguf_mixed import encode, served_mixed_gguf
from test_gguf_q4km import engine_in_the_stack, gemv_of
from test_gguf_moe import dense_weights, random_gguf_experts

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu, moe
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant.base import LinearKernel, LinearOptions
from lmdeploy.pytorch.nn.quant.gguf import GgufFormat
from lmdeploy.pytorch.nn.quant.gguf_blocks import BLOCKS, dequantize_blocks
from lmdeploy.pytorch.nn.quant.parts import PartsKernel
from lmdeploy.pytorch.nn.quant.q5k_cpu import Q5KGemv, pack_q5k, unpack_q5k
from lmdeploy.pytorch.nn.quant.q6k_cpu import GEMV_MAX_ROWS, Q6KGemv
from lmdeploy.pytorch.nn.quant.w4a16 import ReferenceKernel

# llama.cpp's Q5_K_M on a 2-layer model: Q6_K in layer 0's attn_v and ffn_down and the output, Q5_K elsewhere
Q5_K_M = {'output': Q.Q6_K, 'blk.0.attn_v': Q.Q6_K, 'blk.0.ffn_down': Q.Q6_K, 'default': Q.Q5_K}


def random_q5k(rows: int, inputs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q5_K blocks ``[rows, inputs / 256, 176]`` and gguf's dequantization of them (fp32)."""
    data = encode(np.zeros((rows, inputs), dtype=np.float32), Q.Q5_K, np.random.default_rng(seed))
    expected = torch.from_numpy(dequantize(data, Q.Q5_K).astype(np.float32))
    return torch.from_numpy(data).view(rows, inputs // 256, 176), expected


def test_q5_k_blocks_and_their_retiling_are_the_file_weights():
    """Both the blocks and the GEMV's retiled copy dequantize to gguf's weights exactly, at 0.69 bytes a weight."""
    blocks, expected = random_q5k(48, 768)
    assert torch.equal(dequantize_blocks(blocks, 'Q5_K'), expected)
    codes, scales = pack_q5k(blocks)
    assert codes.shape == (3, 24, 320) and scales.shape == (3, 3, 256)
    assert codes.numel() + scales.numel() == blocks.numel()
    assert torch.equal(unpack_q5k(codes, scales), expected)
    if cpu.q5k_gemv() is not None:  # larger steps' native dequantization
        assert torch.equal(cpu.native().q5k_dequantize(codes, scales), expected.bfloat16())


@pytest.mark.parametrize('amx, rows', [(True, 1), (True, 3), (True, 4), (True, 7), (True, 'bound'),
                                       (True, 'above'), (False, 'bound'), (False, 'above')])
def test_q5_k_kernel_is_the_file_weights(amx, rows, monkeypatch):
    """bf16 activations (their values, not quantized): steps of up to ``gemv_max_rows('q5k')`` rows (chosen at load,
    by AMX or not) on the GEMV give ``x @ W.T`` of gguf's weights up to fp32 summation order (rows of x in blocks
    of 4 and alone alike), larger ones the bf16 GEMM of the weights dequantized for the call."""
    if cpu.q5k_gemv() is None:
        pytest.skip('the native Q5_K GEMV needs AVX512-BF16')
    monkeypatch.setattr(cpu, 'onednn_amx', lambda: amx)
    bound = GEMV_MAX_ROWS['q5k'][0 if amx else 1]
    rows = {'bound': bound, 'above': bound + 5}.get(rows, rows)
    blocks, expected = random_q5k(80, 512, seed=rows)  # 5 tiles of 16 rows
    gemv = Q5KGemv.of(blocks)
    kernel = gemv.layer_kernel()  # outside an engine step it chooses by the rows
    assert kernel.small_step_rows == bound
    x = torch.randn(rows, 512).bfloat16()
    bias = torch.randn(80).bfloat16()
    if rows <= bound:
        reference = x.float() @ expected.T
        out = cpu.native().q5k_linear(x, gemv.codes, gemv.scales)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        assert torch.equal(out[-1:], cpu.native().q5k_linear(x[-1:], gemv.codes, gemv.scales))
        assert torch.equal(kernel(x, bias), out.bfloat16() + bias)
    else:
        assert torch.equal(kernel(x, bias), large_step_reference(x, expected.bfloat16(), bias))


def test_q5_k_in_fp32_is_dequantized_once():
    """fp32 on the CPU dequantizes the blocks once at load (and drops them): gguf's weights exactly."""
    blocks, expected = random_q5k(40, 256, seed=9)
    layer = torch.nn.Module()
    layer.qweight, layer.gate_up_panels = blocks, False
    kernel = GgufFormat('Q5_K').make_kernel(layer, LinearOptions(False, dtype=torch.float32))
    assert isinstance(kernel, fp32_kernel()) and layer.qweight is None
    assert torch.equal(dequantized_weight(kernel), expected)
    x = torch.randn(3, 256)
    torch.testing.assert_close(kernel(x, None), torch.nn.functional.linear(x, expected), rtol=1e-5, atol=1e-4)
    assert Q5KGemv.of(blocks) is None  # 40 rows: not whole tiles of 16


@pytest.fixture(scope='module')
def q5_k_m(tmp_path_factory) -> str:
    return served_mixed_gguf('llama', tmp_path_factory.mktemp('q5km'), Q5_K_M)


def test_q5_k_m_file_gives_transformers_tokens(q5_k_m):
    """The Q5_K projections stay uint8 blocks of 176 bytes (a q/k/v of Q5_K q and k and Q6_K v part by part), in
    fp32 dequantized once at load; the greedy tokens are transformers' reading the .gguf, batched equal to alone,
    every KV block given back."""
    name = 'model.layers.1.mlp.down_proj.qweight'
    weight_map = json.loads((Path(q5_k_m) / 'model.safetensors.index.json').read_text())['weight_map']
    with safe_open(str(Path(q5_k_m) / weight_map[name]), 'pt') as shard:
        blocks = shard.get_tensor(name)
    assert blocks.dtype == torch.uint8 and blocks.shape == (256, 512 // 256, 176)
    engine = make_engine(q5_k_m)
    try:
        model = engine.runner.model
        down = model.get_submodule('layers.1.mlp.down_proj')
        assert down.weight_format.ggml_type == 'Q5_K' and isinstance(down.kernel, fp32_kernel())
        assert torch.equal(dequantized_weight(down.kernel), dequantize_blocks(blocks, 'Q5_K'))
        qkv = model.get_submodule('layers.0.self_attn.qkv_proj')
        assert [part.ggml_type for part in qkv.weight_format.parts] == ['Q5_K', 'Q5_K', 'Q6_K']
        prompts = random_prompts([9, 30, 4], seed=5, vocab=250)
        batched = run(engine, prompts)
        solo = [run(engine, [prompt])[0] for prompt in prompts]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    assert batched == solo
    folder = q5_k_m.rpartition('/')[0]
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file='model.gguf', dtype=torch.float32).eval()
    assert_transformers_greedy(reference, prompts, batched)


def test_bf16_q5_k_m_file_runs_q5_k_on_the_gemv(q5_k_m):
    """bf16 on the CPU: the Q5_K layers on their kernel (no bf16 copy), tokens for every prompt, blocks given back."""
    if os.environ.get('LMDEPLOY_TEST_DEVICE', 'cpu') != 'cpu' or cpu.q5k_gemv() is None:
        pytest.skip('the native Q5_K GEMV needs AVX512-BF16 on the CPU')
    engine = Engine(q5_k_m, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16,
                                                max_prefill_token_num=48), show_progress=False)
    try:
        down = engine.runner.model.get_submodule('layers.1.mlp.down_proj')
        assert gemv_of(down.kernel) is Q5KGemv and down.qweight is None
        prompts = random_prompts([40, 7], seed=3, vocab=250)
        outs = run(engine, prompts)
        assert [len(out) for out in outs] == [32, 32]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()


def held_tensors(kernel: LinearKernel) -> list[torch.Tensor]:
    """The tensors a layer's kernel holds, its parts' and its small and large steps' kernels' too, each once."""
    held = {}
    for value in vars(kernel).values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, torch.Tensor):
                held[id(item)] = item
            elif isinstance(item, LinearKernel):
                held.update((id(t), t) for t in held_tensors(item))
    return list(held.values())


def test_q5_k_m_runs_in_the_stack(q5_k_m, native_gemms, monkeypatch):
    """bf16 on the CPU: Q5_K layers and Q6_K ones (decode rows on each one's GEMV, prefill rows dequantized per
    call) and layer 0's q/k/v of both part by part run in the native decoder stack,
    every step's hidden states equal to the layers' forward; each projection holds only its retiled blocks, as many
    bytes as the file's (no bf16 copy)."""
    if cpu.q5k_gemv() is None or cpu.q6k_gemv() is None:
        pytest.skip('the native Q5_K and Q6_K GEMVs need AVX512-BF16')
    engine, model = engine_in_the_stack(q5_k_m)
    qkv = model.get_submodule('layers.0.self_attn.qkv_proj').kernel
    assert isinstance(qkv, PartsKernel) and [gemv_of(part) for part in qkv.parts] == [Q5KGemv, Q5KGemv, Q6KGemv]
    assert gemv_of(model.get_submodule('layers.0.mlp.down_proj').kernel) is Q6KGemv
    for name, layer in model.layers.named_modules():
        if isinstance(layer, Linear):
            types = layer.weight_format.parts if isinstance(layer.kernel, PartsKernel) else [layer.weight_format]
            sizes = [stop - start for start, stop in zip(layer.offsets, layer.offsets[1:])] if len(types) > 1 else [
                layer.out_features]
            file_bytes = sum(rows * layer.in_features // 256 * BLOCKS[t.ggml_type][1] for rows, t in zip(sizes, types))
            held = held_tensors(layer.kernel)
            assert {t.dtype for t in held} == {torch.uint8}, name
            assert sum(t.numel() for t in held) == file_bytes, name
    steps = check_every_step(engine, monkeypatch)
    outs = run(engine, random_prompts([20, 70, 9], seed=8, vocab=250),
               GenerationConfig(max_new_tokens=6, ignore_eos=True))
    assert [len(out) for out in outs] == [6] * 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert (0, 3) in steps and any(prefill > 0 for prefill, _ in steps)  # decode steps, and prefill steps


def test_without_the_gemv_bf16_layers_and_experts_dequantize_per_call(monkeypatch):
    """Where the GEMV is not built (no AVX512-BF16) a bf16 Q5_K layer and a MoE layer's Q5_K experts keep their
    blocks and dequantize them on each call: gguf's weights."""
    monkeypatch.setattr(cpu, 'q5k_gemv', lambda: None)
    blocks, expected = random_q5k(32, 256, seed=11)
    layer = torch.nn.Module()
    layer.qweight, layer.gate_up_panels = blocks, False
    kernel = GgufFormat('Q5_K').make_kernel(layer, LinearOptions(True, dtype=torch.bfloat16))
    assert isinstance(kernel, ReferenceKernel)
    x = torch.randn(2, 256).bfloat16()
    assert torch.equal(kernel(x, None), torch.nn.functional.linear(x, expected.bfloat16()))
    experts = random_gguf_experts({'gate_up': 'Q4_K', 'down': 'Q5_K'})
    gate_up, down = dense_weights(experts)
    experts.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
    assert all(isinstance(experts.kernel.kernel('down', e), ReferenceKernel) for e in range(4))
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 256, generator=g).bfloat16()
    weights, ids = moe.moe_routing(torch.randn(5, 4, generator=g), 2, True)
    out = experts(hidden, weights, ids).float()
    expected_out = moe.fused_moe(hidden.float(), gate_up, down, weights, ids)
    assert (out - expected_out).norm() / expected_out.norm() < 1e-2
