"""A Q4_K_M file as llama.cpp writes it (Q4_K, with Q6_K in some ``attn_v`` and ``ffn_down`` and the output)
served in bf16 on the CPU: Q6_K on the native Q6_K GEMV (larger steps dequantized natively per call, no bf16 copy)
and Q4_K on the Q4_K GEMV, both exactly the file's weights (against the ``gguf`` package's own dequantization), a
q/k/v layer of Q4_K q and k and Q6_K v part by part, and every layer in the native decoder stack, equal to the
layers' own forward at every step; in fp32 the greedy tokens of transformers reading the file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM
from helpers import assert_transformers_greedy, fp32_kernel, large_step_reference, make_engine, random_prompts, run
from test_decoder_stack import check_every_step
from test_gguf_mixed import encode, served_mixed_gguf

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearOptions
from lmdeploy.pytorch.nn.quant.gguf import GgufFileFormat, GgufFormat
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q6K_LM_HEAD_GEMV_MAX_ROWS, int8_unpack, q4_k_grid
from lmdeploy.pytorch.nn.quant.int4_cpu import NativeInt4Kernel, SmallStepInt4Kernel, TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.parts import PartsKernel
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import (GEMV_MAX_ROWS, Q6K_PACK_ROWS, Q6K_TILE, Q6KGemv, gemv_max_rows,
                                               pack_q6k)

# llama.cpp's Q4_K_M on a 2-layer model: Q6_K in layer 0's attn_v and ffn_down (so its q/k/v run part by part)
# and the output
Q4_K_M = {'output': Q.Q6_K, 'blk.0.attn_v': Q.Q6_K, 'blk.0.ffn_down': Q.Q6_K, 'default': Q.Q4_K}


def random_blocks(qtype: Q, rows: int, inputs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``qtype`` blocks ``[rows, inputs / 256, bytes]`` and gguf's dequantization of them (fp32)."""
    data = encode(np.zeros((rows, inputs), dtype=np.float32), qtype, np.random.default_rng(seed))
    expected = torch.from_numpy(dequantize(data, qtype).astype(np.float32))
    return torch.from_numpy(data).view(rows, inputs // 256, -1), expected


def test_q6_k_codes_and_scales_are_the_file_weights():
    blocks, expected = random_blocks(Q.Q6_K, 48, 512)
    codes, scales = int8_unpack(blocks, 'Q6_K')
    assert codes.dtype == torch.int8 and int(codes.min()) >= -32 and int(codes.max()) <= 31
    assert scales.shape == (48, 512 // 16)
    assert torch.equal(codes.view(48, 32, 16).float() * scales[..., None], expected.view(48, 32, 16))


@pytest.mark.parametrize('rows', [1, 3, 4, 7, 16, 40])
def test_q6_k_gemv_is_the_file_weights(rows):
    """The Q6_K GEMV on the file's codes and scales gives ``x @ W.T`` of gguf's weights up to fp32 summation
    order, with bf16 activations (their values, not quantized); rows of x in blocks of 4 and alone alike."""
    if cpu.q6k_gemv() is None:
        pytest.skip('the native Q6_K GEMV needs AVX512-BF16')
    blocks, expected = random_blocks(Q.Q6_K, 64, 768, seed=rows)
    kernel = Q6KGemv.of(blocks, fp32_out=True)
    x = torch.randn(rows, 768).bfloat16()
    reference = x.float() @ expected.T
    out = kernel(x, None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    assert torch.equal(out[-1:], kernel(x[-1:], None))
    assert Q6KGemv.of(blocks)(x, None).dtype == torch.bfloat16


def test_q6_k_gemv_packs_a_long_layer_in_parts_as_a_whole():
    """An output layer longer than ``Q6K_PACK_ROWS`` rows is retiled part by part into the same bytes as at once."""
    if cpu.q6k_gemv() is None:
        pytest.skip('the native Q6_K GEMV needs AVX512-BF16')
    rows = Q6K_PACK_ROWS + 3 * Q6K_TILE
    blocks = torch.randint(0, 256, (rows, 1, 210), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    kernel, (packed, scales) = Q6KGemv.of(blocks, fp32_out=True), pack_q6k(blocks)
    assert torch.equal(kernel.packed, packed) and torch.equal(kernel.scales, scales)


def test_gemv_bounds_follow_the_cpu(monkeypatch):
    """The K-quant layers' GEMV bounds are chosen from torch's answer on AMX, as the bf16 GEMM is; an unknown
    kind is refused."""
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, '_is_amx_tile_supported', lambda amx=amx: amx)
        assert cpu.onednn_amx() is amx
        assert (cpu.bf16_gemm() is None) is (amx or cpu.native() is None or not cpu.native().bf16_gemm_available())
        assert {kind: gemv_max_rows(kind) for kind in GEMV_MAX_ROWS} == {
            kind: bounds[0 if amx else 1] for kind, bounds in GEMV_MAX_ROWS.items()}
    with pytest.raises(KeyError):
        gemv_max_rows('q3k')


@pytest.mark.parametrize('amx', [True, False])
def test_q6_k_layer_holds_its_blocks_and_dequantizes_larger_steps(amx, monkeypatch):
    """A bf16 Q6_K layer keeps only its retiled blocks (as many bytes as the file's, no bf16 copy): steps of up to
    ``gemv_max_rows('q6k')`` rows (chosen at load, by AMX or not) on the GEMV, larger ones on ``F.linear`` of
    ``q6k_dequantize``, which gives gguf's weights rounded to bf16 exactly."""
    if cpu.q6k_gemv() is None:
        pytest.skip('the native Q6_K GEMV needs AVX512-BF16')
    monkeypatch.setattr(cpu, 'onednn_amx', lambda: amx)
    blocks, expected = random_blocks(Q.Q6_K, 48, 768, seed=3)
    layer = torch.nn.Module()
    layer.qweight, layer.gate_up_panels = blocks, False
    kernel = GgufFormat('Q6_K').make_kernel(layer, LinearOptions(True, dtype=torch.bfloat16))
    assert isinstance(kernel, SmallStepInt4Kernel) and isinstance(kernel.small, Q6KGemv) and layer.qweight is None
    gemv = kernel.small
    assert kernel.large.codes is gemv.packed and kernel.large.scales is gemv.scales  # one copy
    assert gemv.packed.dtype == gemv.scales.dtype == torch.uint8
    assert gemv.packed.numel() + gemv.scales.numel() == blocks.numel()
    assert torch.equal(cpu.native().q6k_dequantize(gemv.packed, gemv.scales), expected.bfloat16())
    bound = kernel.small_step_rows
    assert bound == GEMV_MAX_ROWS['q6k'][0 if amx else 1]
    monkeypatch.setattr(cpu, 'onednn_amx', lambda: not amx)  # chosen at load: a later answer changes nothing
    bias = torch.randn(48).bfloat16()
    big = torch.randn(bound + 1, 768).bfloat16()
    assert torch.equal(kernel(big, bias), large_step_reference(big, expected.bfloat16(), bias))
    small = big[:bound]
    assert torch.equal(kernel(small, bias), cpu.native().q6k_linear(small, gemv.packed, gemv.scales).bfloat16() + bias)


@pytest.mark.parametrize('rows', [1, 3, 4, 7, 40])
def test_q4_k_gemv_is_the_file_weights(rows):
    """The Q4_K GEMV on the file's codes and 6-bit scales gives ``x @ W.T`` of gguf's weights up to fp32 summation
    order and the bf16 result (bf16 activations as they are); rows of x in blocks of 4 and alone alike; a gate-and-up
    layer's ``silu(gate) * up`` likewise."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native Q4_K GEMV needs AVX512-BF16')
    blocks, expected = random_blocks(Q.Q4_K, 64, 768, seed=rows)
    x = torch.randn(rows, 768).bfloat16()
    reference = x.float() @ expected.T
    out = Q4KGemv.of_blocks(blocks)(x, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=2**-8, atol=1e-5 * reference.abs().max().item())
    assert (out != reference.bfloat16()).float().mean() < 0.02  # off by a bf16 step where the sums' order tips it
    gate_up = Q4KGemv.of_blocks(blocks, gate_up=True)
    silu = torch.nn.functional.silu(reference[:, :32]) * reference[:, 32:]
    torch.testing.assert_close(gate_up.gate_up_silu(x, None).float(), silu, rtol=2**-7,
                               atol=1e-4 * silu.abs().max().item())
    assert torch.equal(out[-1:], Q4KGemv.of_blocks(blocks)(x[-1:], None))


@pytest.mark.parametrize('amx', [True, False])
@pytest.mark.parametrize('gate_up', [False, True])
def test_q4_k_layer_holds_its_blocks_and_dequantizes_larger_steps(gate_up, amx, monkeypatch):
    """A bf16 Q4_K layer keeps only the GEMV's codes and the file's scales (as many bytes as the file's blocks, no
    int4 or bf16 copy): steps of up to ``gemv_max_rows('q4k')`` rows (chosen at load, by AMX or not) on the GEMV,
    larger ones on ``F.linear`` of ``q4k_dequantize``, which gives gguf's weights rounded to bf16 exactly (a
    gate-and-up layer's as [gate; up], its SiLU then applied by the layer)."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native Q4_K GEMV needs AVX512-BF16')
    monkeypatch.setattr(cpu, 'onednn_amx', lambda: amx)
    blocks, expected = random_blocks(Q.Q4_K, 64, 768, seed=4)
    layer = block_layer(blocks, gate_up)
    kernel = GgufFormat('Q4_K').make_kernel(layer, LinearOptions(True, dtype=torch.bfloat16))
    assert isinstance(kernel, SmallStepInt4Kernel) and isinstance(kernel.small, Q4KGemv) and layer.qweight is None
    gemv = kernel.small
    assert kernel.large.codes is gemv.packed and kernel.large.scales is gemv.scales  # one copy
    assert gemv.packed.dtype == gemv.scales.dtype == torch.uint8
    assert gemv.packed.numel() + gemv.scales.numel() == blocks.numel()
    assert torch.equal(cpu.native().q4k_dequantize(gemv.packed, gemv.scales, gate_up), expected.bfloat16())
    bound = kernel.small_step_rows
    assert bound == GEMV_MAX_ROWS['q4k'][0 if amx else 1]
    bias = None if gate_up else torch.randn(64).bfloat16()
    big = torch.randn(bound + 1, 768).bfloat16()
    assert torch.equal(kernel(big, bias), large_step_reference(big, expected.bfloat16(), bias))
    assert kernel.gate_up_silu(big, bias) is None
    small = big[:bound]
    if gate_up:
        silu = cpu.native().q4k_gate_up_silu(small, gemv.packed, gemv.scales)
        assert torch.equal(kernel.gate_up_silu(small, None), silu)
    else:
        assert torch.equal(kernel(small, bias), cpu.native().q4k_linear(small, gemv.packed, gemv.scales, bias))


def test_q4_k_dequantize_rejects_other_layouts():
    """``q4k_dequantize`` checks its codes and scales against each other."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native Q4_K GEMV needs AVX512-BF16')
    blocks, _ = random_blocks(Q.Q4_K, 48, 512)
    kernel = Q4KGemv.of_blocks(blocks)
    with pytest.raises(RuntimeError, match='scales: uint8'):
        cpu.native().q4k_dequantize(kernel.packed, kernel.scales[:, :1].contiguous())
    with pytest.raises(RuntimeError, match='gate_up: pairs of tiles'):
        cpu.native().q4k_dequantize(kernel.packed, kernel.scales, True)


def test_without_the_gemv_q4_k_runs_on_torch_int4_kernel(monkeypatch):
    """Where the Q4_K GEMV is not built (no AVX512-BF16) a bf16 Q4_K layer runs every step on torch's int4 kernel
    (scales in bf16), within bf16 rounding of gguf's weights."""
    monkeypatch.setattr(cpu, 'int4_gemv', lambda: None)
    blocks, expected = random_blocks(Q.Q4_K, 48, 512, seed=6)
    kernel = GgufFormat('Q4_K').make_kernel(block_layer(blocks), LinearOptions(True, dtype=torch.bfloat16))
    assert isinstance(kernel, TorchInt4Kernel)
    for rows in (1, 40):
        x = torch.randn(rows, 512).bfloat16()
        reference = x.float() @ expected.T
        assert (kernel(x, None).float() - reference).norm() / reference.norm() < 1e-2


def block_layer(blocks: torch.Tensor, gate_up: bool = False) -> torch.nn.Module:
    """A stand-in for a GGUF layer holding ``blocks`` (what ``GgufFormat.make_kernel`` reads)."""
    layer = torch.nn.Module()
    layer.qweight, layer.gate_up_panels = blocks, gate_up
    return layer


def test_q4_k_on_the_int4_gemv_within_fp16_scales():
    """Q4_K's codes as they are on the int4 GEMV; ``d * sc`` and ``dmin * m`` rounded to fp16 (2^-11 at worst)."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    blocks, expected = random_blocks(Q.Q4_K, 64, 512, seed=4)
    kernel = NativeInt4Kernel.of_grid(q4_k_grid(blocks))
    for rows in (1, 5, 40):
        x = torch.randn(rows, 512).bfloat16()
        reference = x.float() @ expected.T
        error = (kernel(x, None).float() - reference).norm() / reference.norm()
        assert error < 4e-3, (rows, error)


def test_q6_k_lm_head_runs_small_steps_on_the_file_blocks():
    """An output layer kept as Q6_K blocks loads dequantized (gguf's weights) and runs steps of up to
    ``Q6K_LM_HEAD_GEMV_MAX_ROWS`` rows on the Q6_K GEMV over the blocks (fp32 logits), larger ones on the table."""
    if cpu.q6k_gemv() is None:
        pytest.skip('the native Q6_K GEMV needs AVX512-BF16')
    blocks, expected = random_blocks(Q.Q6_K, 90, 256, seed=7)  # rows padded to the GEMV's tiles of 16
    weight_format = GgufFileFormat({}, lm_head='Q6_K')
    (name, table), = weight_format.convert_checkpoint([('lm_head.qweight', blocks)])
    assert name == 'lm_head.weight' and torch.equal(table, expected)
    head = weight_format.lm_head_kernel(table.bfloat16())
    assert isinstance(head, SmallStepInt4Kernel) and weight_format.lm_head_blocks is None
    x = torch.randn(1, 256).bfloat16()
    logits = head(x, None)
    assert logits.shape == (1, 96) and not logits[:, 90:].any()
    torch.testing.assert_close(logits[:, :90], x.float() @ expected.T, rtol=1e-5, atol=1e-5)
    big = torch.randn(Q6K_LM_HEAD_GEMV_MAX_ROWS + 1, 256).bfloat16()
    reference = big.float() @ expected.T
    assert (head(big, None).float() - reference).norm() / reference.norm() < 1e-2


@pytest.fixture(scope='module')
def q4_k_m(tmp_path_factory) -> str:
    return served_mixed_gguf('llama', tmp_path_factory.mktemp('q4km'), Q4_K_M)


def test_mixed_qkv_part_by_part_gives_transformers_tokens(q4_k_m):
    """Layer 0's q/k/v (Q4_K, Q4_K, Q6_K) is kept part by part (in fp32 on the CPU its parts dequantized once, as one
    weight); in fp32 the greedy tokens are transformers' reading the .gguf (which dequantizes every tensor). On CUDA
    the Q6_K part, ``down_proj`` and output layer run on the Triton Q6_K GEMM, the output layer's dequantized table
    released."""
    engine = make_engine(q4_k_m)
    try:
        model = engine.runner.model
        qkv = model.get_submodule('layers.0.self_attn.qkv_proj')
        on_cuda = model.layers[0].input_layernorm.weight.is_cuda
        assert qkv.weight_format.parts[2].ggml_type == 'Q6_K'
        assert isinstance(qkv.kernel, PartsKernel if on_cuda else fp32_kernel())
        if on_cuda:
            from lmdeploy.pytorch.nn.quant.gguf_cuda import TritonQ6KKernel
            down = model.get_submodule('layers.0.mlp.down_proj')
            assert isinstance(qkv.kernel.parts[2], TritonQ6KKernel) and isinstance(down.kernel, TritonQ6KKernel)
            assert isinstance(model.lm_head.packed, TritonQ6KKernel) and model.lm_head.weight is None
        prompts = random_prompts([9, 30], seed=5, vocab=250)
        outs = run(engine, prompts)
    finally:
        engine.close()
    folder = q4_k_m.rpartition('/')[0]
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file='model.gguf', dtype=torch.float32).eval()
    assert_transformers_greedy(reference, prompts, outs)


def engine_in_the_stack(path: str) -> tuple[Engine, torch.nn.Module]:
    """A bf16 engine on a GGUF file whose K-quant layers all run in the native decoder stack (decode rows in
    ``small``, on each layer's GEMV; prefill rows in ``large``, dequantized), and its model."""
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16,
                                              enable_prefix_caching=False, max_prefill_token_num=128),
                    show_progress=False)
    stack = engine.runner.model.native_stack
    assert stack is not None and stack.small is not None and stack.small_step_rows == gemv_max_rows('q4k')
    return engine, engine.runner.model


def gemv_of(kernel: object) -> type:
    """The type of a dense K-quant layer's GEMV (its kernel for decode rows)."""
    assert isinstance(kernel, SmallStepInt4Kernel)
    return type(kernel.small)


def test_q4_k_m_runs_in_the_stack(q4_k_m, native_gemms, monkeypatch):
    """Q4_K layers and Q6_K ones (decode rows on each one's GEMV, prefill rows dequantized per call) and the q/k/v of
    both part by part all run in the native decoder stack, every step equal to the layers' forward."""
    if cpu.int4_gemv() is None or cpu.q6k_gemv() is None:
        pytest.skip('the native int4 and Q6_K GEMVs need AVX512-BF16')
    engine, model = engine_in_the_stack(q4_k_m)
    assert isinstance(model.lm_head.packed, SmallStepInt4Kernel)
    qkv = model.get_submodule('layers.0.self_attn.qkv_proj').kernel
    assert isinstance(qkv, PartsKernel) and [gemv_of(part) for part in qkv.parts] == [Q4KGemv, Q4KGemv, Q6KGemv]
    assert gemv_of(model.get_submodule('layers.0.mlp.down_proj').kernel) is Q6KGemv
    assert gemv_of(model.get_submodule('layers.0.mlp.gate_up_proj').kernel) is Q4KGemv
    assert gemv_of(model.get_submodule('layers.1.self_attn.qkv_proj').kernel) is Q4KGemv
    steps = check_every_step(engine, monkeypatch)
    outs = run(engine, random_prompts([20, 110, 9], seed=8, vocab=250),
               GenerationConfig(max_new_tokens=6, ignore_eos=True))
    assert [len(out) for out in outs] == [6] * 3
    assert (0, 3) in steps and any(prefill > 0 for prefill, _ in steps)  # decode steps, and prefill steps
