"""Llama 4 (text) in the native decoder stack: its rope layers' chunked attention (``attention_chunk``) and L2 q/k
norm after the rotary (``qk_l2_norm_eps``), its NoPE layers' queries scaled by the step's temperatures
(``scaled_queries``), its MoE layers as ``MoEBlock``s routed ``sigmoid_scaled_input`` with the shared expert, against
the layers' own forward: every step's hidden states equal, and each option shown to count."""
from __future__ import annotations

import pytest
import torch
from helpers import random_prompts
from test_decoder_stack import ENGINE, differences_without_an_option
from test_decoder_stack_moe import run_checked
from test_llama4 import save_llama4

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.models import llama
from lmdeploy.pytorch.models.llama4 import Llama4MoE
from lmdeploy.pytorch.nn.decoder_stack import layer_weights

# top1: the tests' Llama 4 (chunks of 8, the L2 q/k norm, a NoPE layer whose temperature bites within the prompts,
# MoE layers 1 and 3 routing one expert a token); top2: two experts a token in every layer, without the q/k norm
VARIANTS = {'top1': {}, 'top2': dict(num_experts_per_tok=2, interleave_moe_layer_step=1, use_qk_norm=False)}


def llama4_engine(path: str, **config) -> Engine:
    return Engine(path, PytorchEngineConfig(**{**ENGINE, **config}), show_progress=False)


def moe_blocks(engine: Engine) -> list[Llama4MoE]:
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, Llama4MoE)]
    assert blocks
    return blocks


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_llama4_stack_equals_the_layers(variant, tmp_path, native_gemms, monkeypatch):
    """Every layer in the stack, equal to the layers' forward at every step, over chunked prefills (48 tokens a
    step, chunks of 8 positions), mixed and decode steps."""
    engine = llama4_engine(save_llama4(str(tmp_path), **VARIANTS[variant]), max_prefill_token_num=48)
    assert engine.runner.model.native_stack is not None
    blocks = moe_blocks(engine)
    assert all(block.native_moe() is not None for block in blocks)
    steps = run_checked(engine, monkeypatch)
    assert any(0 < prefill < rows for prefill, rows in steps) and any(prefill == 0 for prefill, _ in steps)
    assert any(prefill == rows == 48 for prefill, rows in steps) and (0, 1) in steps


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_llama4_block_equals_the_python_forward(variant, tmp_path, native_gemms):
    """The ``MoEBlock`` alone gives ``Llama4MoE.forward``'s output bit for bit, one or two experts a token, at 1, 5
    and 40 tokens."""
    g = torch.Generator().manual_seed(0)
    for block in moe_blocks(llama4_engine(save_llama4(str(tmp_path), **VARIANTS[variant]))):
        for tokens in (1, 5, 40):
            x = torch.randn(tokens, 64, generator=g).bfloat16()
            assert torch.equal(block.native_moe()(x=x), block(x))


def test_llama4_routing_scales_the_inputs(tmp_path, native_gemms):
    """The block routed ``softmax`` (the scores weighting the experts' outputs, not scaling their inputs) differs
    from ``Llama4MoE.forward``."""
    block = moe_blocks(llama4_engine(save_llama4(str(tmp_path))))[0]
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    native = block.native_moe()
    assert torch.equal(native(x=x), block(x))
    softmax = native_gemms.MoEBlock(router=block.router.kernel.router_projection(None), top_k=block.top_k,
                                    renormalize=True, routing='softmax', **block.experts.kernel.native_experts())
    difference = (softmax(x=x) + block.shared_expert(x) - block(x)).float().abs().max().item()
    print(f"Llama 4 block routed 'softmax': differs by {difference:.3g}")
    assert difference > 0.01


@pytest.mark.parametrize('option', ['attention_chunk', 'qk_l2_norm_eps', 'scaled_queries'])
def test_llama4_options_matter(option, tmp_path, native_gemms, monkeypatch):
    """Each of Llama 4's options counts: a stack built without it gives other hidden states than the layers, where
    the stack built with it gives theirs (the prompts reach past the first chunk and the temperature's first
    step)."""
    engine = llama4_engine(save_llama4(str(tmp_path)))

    def without_option(input_norm, post_norm, projections, small_step=False, **options):
        options[option] = False if option == 'scaled_queries' else None
        return layer_weights(input_norm, post_norm, projections, small_step, **options)

    differences = differences_without_an_option(engine, monkeypatch, llama, without_option,
                                                random_prompts([30, 20], seed=4))
    print(f'Llama 4 without {option}: hidden states differ by up to {max(differences):.3g}')
    assert max(differences) > 0.01


def test_llama4_small_int4_steps_run_in_the_stack(tmp_path, native_gemms, monkeypatch):
    """With ``decode_int4`` steps of up to two tokens run in the stack's small-step layers (attention, dense MLPs and
    the shared expert on their 4-bit copies), equal to the layers' forward on them."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    engine = llama4_engine(save_llama4(str(tmp_path)), decode_int4=True)
    stack = engine.runner.model.native_stack
    assert stack.small is not None and stack.small_step_rows == 2
    steps = run_checked(engine, monkeypatch, batched_equals_solo=False)
    assert (0, 1) in steps and (0, 4) in steps
