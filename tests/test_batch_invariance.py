"""A prompt's output does not depend on what else shares its steps, on the paths with kernels of their own for small
steps (``decode_int4``'s 4-bit copies on the native GEMV or torch's int4 kernel, the LM head's one-row copy, GGUF
K-quant layers' GEMVs): greedy tokens and their logprobs, bitwise, of prompts run together (decode steps of more rows
than the small-step bound) and arriving one a step (their prefills sharing steps with others' decode rows) equal each
prompt's run alone; and each small-step kernel's rows, bitwise, do not depend on their number."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import random_prompts
from test_gguf_mixed import encode, served_mixed_gguf
from test_gguf_q4km import Q4_K_M, random_blocks

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.cpu_bf16 import NativeBf16Kernel
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv, q8_0_unpack
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel, TorchInt4Kernel, int4_groups
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv
from lmdeploy.pytorch.nn.quant.q5k_cpu import Q5KGemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import GEMV_MAX_ROWS, Q6KGemv
from lmdeploy.pytorch.nn.quant.q8_cpu import Q8Gemv, pack_q8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run  # noqa: E402

GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)
ROW_COUNTS = (1, 2, 5, 16, 24, 64)

def assert_batch_invariant(engine: Engine, prompts: list[list[int]]) -> None:
    alone = [run(engine, [prompt], GEN, 0)[0] for prompt in prompts]
    assert run(engine, prompts, GEN, 0) == alone  # prefills together, then decode steps of len(prompts) rows
    assert run(engine, prompts, GEN, 1) == alone  # each prefill beside the decode rows of the prompts before it


@pytest.mark.parametrize('gemv', ['native', 'torch'])
@pytest.mark.parametrize('decoder', ['stack', 'layers'])
def test_tiny_int4_small_steps_are_batch_invariant(decoder, gemv, tiny_llama, native_gemms, monkeypatch):
    """bf16 with 4-bit small steps (and the fp16 LM head copy), in the native stack and in the layers' forward, on
    the native int4 GEMV and on torch's int4 kernel (CPUs without AVX512-BF16): prompts of one and two tokens (once
    small steps by their size), decode steps of up to six rows (the bound is two)."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    if gemv == 'torch':
        monkeypatch.setattr(cpu, 'int4_gemv', lambda: None)
    engine = Engine(tiny_llama, PytorchEngineConfig(dtype='bfloat16', decode_int4=True, num_gpu_blocks=64,
                                                    block_size=16, enable_prefix_caching=False), show_progress=False)
    model = engine.runner.model
    kernel = model.layers[0].mlp.gate_up_proj.kernel
    assert isinstance(kernel, SmallStepInt4Kernel) and isinstance(kernel.small, TorchInt4Kernel) == (gemv == 'torch')
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
    """Each row of the 8-bit GEMV's output, bitwise, whether it runs alone (fp32 FMAs) or beside others (bf16 rows:
    vdpbf16ps), tiny activations too: rows of bf16 denormals and of magnitudes near 2^-120, whose sums vdpbf16ps
    would flush where the FMAs keep them; a step of 100 rows too (more than the thread's buffer of a tile's sums held
    before)."""
    if cpu.q8_gemv() is None:
        pytest.skip('the native Q8 GEMV needs AVX512-BF16')
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (64, 96), generator=g, dtype=torch.int8)
    gemv = Q8Gemv(*pack_q8(codes, (torch.rand(64, 3, generator=g) / 50).half()))
    for dtype, count in ((torch.bfloat16, 7), (torch.float32, 7), (torch.bfloat16, 100)):
        x = torch.randn(count, 96, generator=g)
        x[2] *= 2.0**-128
        x[4] *= 2.0**-120
        x = x.to(dtype)
        rows = gemv(x)
        assert all(torch.equal(rows[i:i + 1], gemv(x[i:i + 1])) for i in range(count))
        assert all(torch.equal(rows[i:i + 3], gemv(x[i:i + 3])) for i in range(count - 2))


@pytest.fixture(scope='module')
def tiny_q4_k_m(tmp_path_factory) -> str:
    return served_mixed_gguf('llama', tmp_path_factory.mktemp('q4km'), Q4_K_M)


@pytest.mark.parametrize('decoder', ['stack', 'layers'])
def test_tiny_k_quant_layers_are_batch_invariant(decoder, tiny_q4_k_m, native_gemms, monkeypatch):
    """bf16 on a Q4_K_M-like file (Q4_K and Q6_K layers, layer 0's q/k/v part by part, a Q6_K output layer): decode
    rows on the GEMVs, prefill rows dequantized, in the native stack and in the layers' forward. The GEMVs' bound
    is held to 4 rows so that decode steps of six rows and prefills of a few tokens fall on both sides of it."""
    if cpu.int4_gemv() is None or cpu.q6k_gemv() is None:
        pytest.skip('the native Q4_K and Q6_K GEMVs need AVX512-BF16')
    for kind in ('q4k', 'q6k'):
        monkeypatch.setitem(GEMV_MAX_ROWS, kind, (4, 4))
    engine = Engine(tiny_q4_k_m, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16,
                                                     enable_prefix_caching=False), show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None and model.native_stack.small is not None
    if decoder == 'layers':
        model.native_stack = None
    assert_batch_invariant(engine, random_prompts([1, 2, 5, 9, 17, 40], seed=3, vocab=250))


@pytest.fixture(scope='module')
def wide_q4_k_m(tmp_path_factory) -> str:
    """The Q4_K_M-like file at hidden 2048 (32 heads), 4 layers: its projections of 2048 inputs are where oneDNN's
    bf16 GEMM rounded a lone row apart from the same row among others (and 4 layers carry that to the logits)."""
    return served_mixed_gguf('llama', tmp_path_factory.mktemp('q4km_wide'), Q4_K_M, hidden_size=2048,
                             num_attention_heads=32, num_hidden_layers=4)


def test_k_quant_prefills_of_a_token_are_batch_invariant(wide_q4_k_m, native_gemms):
    """Prefills of one and two tokens alone and among others (all prefill rows, on the dequantized weights): equal
    tokens and logprobs, bitwise, now that those rows take the native bf16 GEMM's tiles."""
    if cpu.int4_gemv() is None or not native_gemms.dequantizing_gemm_available():
        pytest.skip('large steps take the native bf16 GEMM with AVX512-BF16 and without AMX')
    engine = Engine(wide_q4_k_m, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16,
                                                     enable_prefix_caching=False), show_progress=False)
    try:
        assert_batch_invariant(engine, random_prompts([1, 2, 1, 2, 1, 9], seed=4, vocab=250))
    finally:
        engine.close()


def test_a_bf16_lm_head_of_a_vocabulary_off_the_panels_is_batch_invariant(tmp_path, native_gemms):
    """A dense bf16 LM head whose vocabulary (263 rows here) does not fill the native GEMM's 16-row panels is padded
    to them, so a one-token prompt's logits do not take oneDNN's one-row rounding alone and another among others."""
    if cpu.int4_gemv() is None or not native_gemms.dequantizing_gemm_available():
        pytest.skip('the native bf16 GEMM runs with AVX512-BF16 and without AMX')
    served = served_mixed_gguf('llama', tmp_path, {**Q4_K_M, 'output': Q.F16}, hidden_size=2048,
                               num_attention_heads=32, num_hidden_layers=1)
    engine = Engine(served, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=32, block_size=16,
                                                enable_prefix_caching=False), show_progress=False)
    try:
        lm_head = engine.runner.model.lm_head
        assert lm_head.vocab_size % 16 and isinstance(lm_head.packed, NativeBf16Kernel)
        assert lm_head.packed.out_features == lm_head.vocab_size < 16 * lm_head.packed.panels.shape[0]
        assert_batch_invariant(engine, random_prompts([1, 1, 2, 1, 5], seed=5, vocab=250))
    finally:
        engine.close()


def k_quant_gemvs() -> dict[str, object]:
    """Each K-quant GEMV on random blocks of 64 rows and 512 inputs (gate and up of 32 rows each for
    ``q4k_gate_up_silu``), as a function of the activations."""
    q4k, _ = random_blocks(Q.Q4_K, 64, 512, seed=1)
    q5k = Q5KGemv.of(random_blocks(Q.Q5_K, 64, 512, seed=2)[0])
    q6k = Q6KGemv.of(random_blocks(Q.Q6_K, 64, 512, seed=3)[0])
    q8_0 = encode(np.zeros((64, 512), dtype=np.float32), Q.Q8_0, np.random.default_rng(4))
    q8 = Q8_0Gemv.of(*q8_0_unpack(torch.from_numpy(q8_0).view(64, 16, 34)))
    linear, gate_up = Q4KGemv.of_blocks(q4k), Q4KGemv.of_blocks(q4k, gate_up=True)
    return {'q4k': lambda x: linear(x, None), 'q4k_gate_up_silu': lambda x: gate_up.gate_up_silu(x, None),
            'q5k': lambda x: cpu.native().q5k_linear(x, q5k.codes, q5k.scales), 'q6k': lambda x: q6k(x, None),
            'q8_0': lambda x: cpu.native().q8_linear(x, q8.packed, q8.scales)}


def test_k_quant_gemv_rows_do_not_depend_on_their_number(native):
    """Each K-quant GEMV's rows, bitwise, the same at every number of rows that decode steps give it."""
    if cpu.int4_gemv() is None or cpu.q5k_gemv() is None or cpu.q6k_gemv() is None or cpu.q8_gemv() is None:
        pytest.skip('the native K-quant GEMVs need AVX512-BF16')
    x = torch.randn(max(ROW_COUNTS), 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    for name, gemv in k_quant_gemvs().items():
        full = gemv(x)
        assert all(torch.equal(gemv(x[:rows]), full[:rows]) for rows in ROW_COUNTS), name
        assert torch.equal(gemv(x[-1:]), full[-1:]), name


def test_torch_int4_rows_do_not_depend_on_their_number():
    """torch's int4 kernel (the 4-bit copies' on CPUs without AVX512-BF16), bitwise likewise, on bf16 rows."""
    g = torch.Generator().manual_seed(0)
    packed, scales_and_zeros = int4_groups(torch.randn(96, 256, generator=g).bfloat16())
    kernel = TorchInt4Kernel(packed, scales_and_zeros)
    x = torch.randn(max(ROW_COUNTS), 256, generator=g).bfloat16()
    full = kernel(x, None)
    assert all(torch.equal(kernel(x[:rows], None), full[:rows]) for rows in ROW_COUNTS)
    assert torch.equal(kernel(x[-1:], None), full[-1:])
