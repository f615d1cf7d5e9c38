"""bf16 weights off the native GEMM's panels (a gate and an up of rows not a multiple of 16 each, an odd number of
inputs) run that GEMM too: zero rows pad each half of a gate-and-up weight to whole panels and a zero column an odd
K (the kernel gives x's rows the matching zero), so each row's bits do not depend on the rows beside it, where
oneDNN, which ran them before, rounds some rows of a call of more than 128 rows apart from the row alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_model
from helpers import random_prompts
from test_batch_invariance import assert_batch_invariant

from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.nn.linear import GateUpLinear, Linear
from lmdeploy.pytorch.nn.quant import LinearOptions
from lmdeploy.pytorch.nn.quant.cpu_bf16 import NativeBf16Kernel

ROWS = 300  # oneDNN rounded some rows of calls of more than 128 rows apart


def packed_layer(layer: Linear, seed: int) -> tuple[Linear, torch.Tensor]:
    """``layer`` in bf16 with random weights, packed for the CPU; and its weight as loaded."""
    g = torch.Generator().manual_seed(seed)
    layer = layer.bfloat16()
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=g) * 0.5)
    weight = layer.weight.detach().clone()
    layer.finalize(LinearOptions(pack_cpu=True))
    assert isinstance(layer.kernel, NativeBf16Kernel)
    return layer, weight


def assert_rows_alone_as_together(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    together = layer(x)
    apart = [i for i in range(x.shape[0]) if not torch.equal(together[i:i + 1], layer(x[i:i + 1]))]
    assert not apart, f'{len(apart)} of {x.shape[0]} rows differ alone'
    return together


@pytest.mark.parametrize('inputs', [97, 2048, 2049])
@pytest.mark.parametrize('bias', [False, True])
def test_gate_up_off_the_panels_is_row_invariant(inputs, bias, native_gemms):
    """A gate-and-up layer of 2 x 24 rows (an odd or an even K): each of 300 rows alone gives its bits among them
    all, through the fused SiLU-and-mul epilogue, within bf16 rounding of silu(gate) * up; the native stack's
    projection on the same panels gives the same bits. oneDNN gave 4 (K = 2048) and 6 (2049) rows other bits."""
    layer, weight = packed_layer(GateUpLinear(inputs, 24, bias=bias), seed=inputs)
    assert layer.kernel.gate_up and layer.kernel.out_features == 48
    x = torch.randn(ROWS, inputs, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = assert_rows_alone_as_together(layer, x)
    gate_up = x.double() @ weight.double().T + (layer.bias.double() if bias else 0)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(got.double(), expected, rtol=0.02, atol=0.02 * expected.abs().mean().item())
    projection = layer.kernel.native_projection(layer.bias)
    assert projection.weight.data_ptr() == layer.kernel.panels.data_ptr() and projection.outputs == 48
    assert torch.equal(projection.gate_up_silu(x=x), got)


@pytest.mark.parametrize('inputs', [97, 2049])
def test_odd_inputs_run_the_native_gemm(inputs, native_gemms):
    """A layer of an odd K and 40 outputs (a partial panel), biased: rows alone as together, within bf16 rounding of
    the product, and the stack's projection equal."""
    layer, weight = packed_layer(Linear(inputs, 40, bias=True), seed=inputs)
    x = torch.randn(ROWS, inputs, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = assert_rows_alone_as_together(layer, x)
    expected = x.double() @ weight.double().T + layer.bias.double()
    torch.testing.assert_close(got.double(), expected, rtol=0.01, atol=0.01 * expected.abs().mean().item())
    assert torch.equal(layer.kernel.native_projection(layer.bias)(x=x), got)


@pytest.fixture(scope='module')
def odd_llama(tmp_path_factory) -> str:
    """A tiny Llama of hidden size 2049 (every projection's K but the down's odd, and o's outputs off the panels)
    and intermediate size 40 (gate and up off the panels)."""
    return save_tiny_model('llama', str(tmp_path_factory.mktemp('odd_llama')), hidden_size=2049, head_dim=16,
                           num_attention_heads=3, num_key_value_heads=1, intermediate_size=40)


@pytest.mark.parametrize('decoder', ['stack', 'layers'])
def test_a_model_off_the_panels_is_batch_invariant(odd_llama, decoder, native_gemms):
    """Every bf16 projection and the LM head on the native GEMM, in the native stack and in the layers' forward:
    prompts alone, together (prefills of up to 208 rows) and arriving one a step, tokens and logprobs bitwise."""
    engine = Engine(odd_llama, PytorchEngineConfig(num_gpu_blocks=128, block_size=16, enable_prefix_caching=False),
                    show_progress=False)
    try:
        model = engine.runner.model
        layers = [module for module in model.modules() if isinstance(module, Linear)]
        assert all(isinstance(layer.kernel, NativeBf16Kernel) for layer in layers)
        assert isinstance(model.lm_head.packed, NativeBf16Kernel)
        if decoder == 'layers':
            model.native_stack = None
        assert (model.native_stack is not None) == (decoder == 'stack')
        assert_batch_invariant(engine, random_prompts([1, 2, 5, 40, 90, 7, 60, 3], seed=5, vocab=300))
    finally:
        engine.close()
