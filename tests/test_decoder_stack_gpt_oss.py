"""gpt-oss in the native decoder stack: attention with sinks and q/k/v/o biases, sliding-window layers (window 8,
prompts far longer) alternating with full ones, YaRN, and its MoE layers as ``MoEBlock``s (the router's bias, the
experts' biases, the clamped SwiGLU; bf16 experts, or an MXFP4 checkpoint's on the native GEMV for decode rows and
dequantized for prefill rows; also from a ``gpt-oss`` GGUF file) against the layers' own forward: every
step's hidden states equal, and each option shown to count."""
from __future__ import annotations

import gguf
import pytest
import torch
from conftest import save_random_model
from family_checks import hf_causal_lm
from helpers import random_prompts, run
from test_decoder_stack import ENGINE, differences_without_an_option
from test_decoder_stack_moe import run_checked
from test_gguf import _add_tokenizer
from test_gguf_archs import hf_config, write_gguf
from test_gpt_oss import save_gpt_oss, save_mxfp4

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.models import llama
from lmdeploy.pytorch.models.moe import SparseMoeBlock
from lmdeploy.pytorch.nn.decoder_stack import layer_weights
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.step_context import step_rows

EXPERTS = ('bf16', 'mxfp4')


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """The tests' gpt-oss (``bf16``) and its MXFP4 checkpoint (``mxfp4``), saved once."""
    root = tmp_path_factory.mktemp('gpt_oss_stack')
    dense = save_gpt_oss(str(root / 'bf16'))
    return {'bf16': dense, 'mxfp4': save_mxfp4(dense, str(root / 'mxfp4'))}


def gpt_oss_engine(path: str, **config) -> Engine:
    return Engine(path, PytorchEngineConfig(**{**ENGINE, **config}), show_progress=False)


def moe_blocks(engine: Engine) -> list[SparseMoeBlock]:
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 4
    return blocks


@pytest.fixture
def mxfp4_kernels(native_gemms):
    if cpu.mxfp4_gemv() is None:
        pytest.skip('the native MXFP4 kernels need AVX-512')


@pytest.mark.parametrize('experts', EXPERTS)
def test_gpt_oss_stack_equals_the_layers(experts, saved, native_gemms, mxfp4_kernels, monkeypatch):
    """Every layer in the stack, equal to the layers' forward at every step, over chunked prefills (48 tokens a step:
    the MXFP4 experts' dequantized path), mixed steps (split in two forwards with MXFP4 experts) and decode steps
    (the GEMV); batched prompts' outputs equal their solo runs'."""
    engine = gpt_oss_engine(saved[experts], max_prefill_token_num=48)
    assert engine.runner.model.native_stack is not None
    assert all(block.native_moe() is not None for block in moe_blocks(engine))
    steps = run_checked(engine, monkeypatch, batched_equals_solo=True)
    # MXFP4 experts have a kernel for small steps: a step's prefill and decode rows run as two forwards
    assert any(0 < prefill < rows for prefill, rows in steps) == (experts == 'bf16')
    assert any(prefill == 0 for prefill, _ in steps)
    assert any(prefill == rows == 48 for prefill, rows in steps) and (0, 1) in steps
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences


@pytest.fixture(scope='module')
def gguf_file(tmp_path_factory) -> str:
    """The tests' gpt-oss as llama.cpp's ``gpt-oss`` file: MXFP4 experts, the rest F32."""
    root = tmp_path_factory.mktemp('gpt_oss_gguf')
    writer = gguf.GGUFWriter(str(root / 'gpt_oss.gguf'), 'gpt-oss')
    vocab = _add_tokenizer(writer)
    hf = hf_causal_lm(save_random_model(hf_config('gpt_oss', vocab), str(root / 'hf'), std={'gate_up_proj': 4.0}))
    write_gguf(hf, 'gpt_oss', writer, {})
    return str(root / 'gpt_oss.gguf')


def test_gguf_gpt_oss_stack_equals_the_layers(gguf_file, tmp_path, native_gemms, mxfp4_kernels, monkeypatch):
    """A ``gpt-oss`` GGUF file (its MXFP4 experts kept as MXFP4) runs in the stack too, equal to the layers."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    engine = gpt_oss_engine(gguf_file, max_prefill_token_num=48)
    assert engine.runner.model.native_stack is not None
    blocks = moe_blocks(engine)
    assert all(block.experts.gate_up_blocks.dtype == torch.uint8 for block in blocks)
    assert all(block.native_moe() is not None for block in blocks)
    steps = run_checked(engine, monkeypatch, batched_equals_solo=False)
    assert any(prefill == 0 for prefill, _ in steps)


@pytest.mark.parametrize('experts', EXPERTS)
def test_gpt_oss_block_equals_the_python_forward(experts, saved, native_gemms, mxfp4_kernels):
    """The ``MoEBlock`` alone gives ``SparseMoeBlock.forward``'s output bit for bit at 1, 5 and 40 tokens (40: 80 rows
    over 4 experts, some expert's beyond ``MXFP4_NATIVE_MAX_ROWS``), as decode rows (the stack of small steps; MXFP4:
    on the GEMV) and as prefill rows (MXFP4: on the dequantized weight)."""
    g = torch.Generator().manual_seed(0)
    for block in moe_blocks(gpt_oss_engine(saved[experts])):
        for tokens in (1, 5, 40):
            x = torch.randn(tokens, 64, generator=g).bfloat16()
            for decode in (True, False):
                with step_rows(decode):
                    assert torch.equal(block.native_moe(small_step=decode)(x=x), block(x))


def test_mxfp4_without_native_kernels_keeps_the_layers(saved, native_gemms, monkeypatch):
    """Without the native MXFP4 kernels (plain AVX2) the MXFP4 experts have no native projection: the model keeps its
    layers' forward (torch's dequantization) and serves."""
    monkeypatch.setattr(cpu, 'mxfp4_gemv', lambda: None)
    engine = gpt_oss_engine(saved['mxfp4'])
    assert engine.runner.model.native_stack is None
    assert all(block.native_moe() is None for block in moe_blocks(engine))
    outs = run(engine, random_prompts([20, 9], seed=3), GenerationConfig(max_new_tokens=6, ignore_eos=True))
    assert [len(out) for out in outs] == [6, 6]


def expert_option_off(option: str):
    """``FusedExperts.native_experts`` with ``option`` switched off: ``clamp`` (the SwiGLU's limit infinite) or
    ``expert_biases`` (none)."""
    original = FusedExperts.native_experts

    def native_experts(experts: FusedExperts, small_step: bool = False) -> dict[str, object] | None:
        native = original(experts, small_step)
        if option == 'clamp':
            return native | dict(swiglu_limit=float('inf'))
        return native | experts.kernel.native_experts(None, None, small_step)

    return native_experts


@pytest.mark.parametrize('option', ['sinks', 'clamp', 'router_bias', 'expert_biases'])
def test_gpt_oss_options_matter(option, saved, native_gemms, monkeypatch):
    """Each of gpt-oss's parts counts: a stack built without it gives other hidden states than the layers, where the
    stack built with it gives theirs."""
    engine = gpt_oss_engine(saved['bf16'])
    block = moe_blocks(engine)[0]
    if option in ('clamp', 'expert_biases'):
        monkeypatch.setattr(FusedExperts, 'native_experts', expert_option_off(option))
    elif option == 'router_bias':
        router_kernel = type(block.gate.kernel)
        original = router_kernel.router_projection
        monkeypatch.setattr(router_kernel, 'router_projection', lambda kernel, bias: original(kernel, None))

    def without_option(input_norm, post_norm, projections, small_step=False, **options):
        if option == 'sinks':
            assert options['sinks'] is not None
            options['sinks'] = None
        return layer_weights(input_norm, post_norm, projections, small_step, **options)

    differences = differences_without_an_option(engine, monkeypatch, llama, without_option,
                                                random_prompts([30, 20], seed=4))
    print(f'gpt-oss without {option}: hidden states differ by up to {max(differences):.3g}')
    assert max(differences) > 0.01


def test_clamped_swiglu_block_fields(native_gemms):
    """The MoE block's activation and expert biases go by name and are checked."""
    weight = torch.zeros(32, 16, dtype=torch.bfloat16)
    router = native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_weight(weight))
    dense = dict(router=router, top_k=2, renormalize=True, routing='softmax', gate_up=torch.zeros(4, 32, 16),
                 down=torch.zeros(4, 16, 16))
    native_gemms.MoEBlock(**dense, gate_up_bias=torch.zeros(4, 32), down_bias=torch.zeros(4, 16),
                          activation='clamped_swiglu', swiglu_alpha=1.702, swiglu_limit=7.0)
    for options, match in [(dict(activation='gelu'), "'silu' or 'clamped_swiglu'"),
                           (dict(activation='clamped_swiglu', swiglu_alpha=1.702), 'takes swiglu_alpha and'),
                           (dict(swiglu_alpha=1.702, swiglu_limit=7.0), 'takes swiglu_alpha and'),
                           (dict(activation='clamped_swiglu', swiglu_alpha=1.0, swiglu_limit=0.0), 'positive'),
                           (dict(gate_up_bias=torch.zeros(4, 16)), r'gate_up_bias is \[E, 2I\]'),
                           (dict(down_bias=torch.zeros(3, 16)), r'down_bias is \[E, H\]')]:
        with pytest.raises(RuntimeError, match=match):
            native_gemms.MoEBlock(**dense, **options)
    projection = native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_weight(weight))
    with pytest.raises(RuntimeError, match='hold their own biases'):
        native_gemms.MoEBlock(router=router, top_k=1, renormalize=True, routing='softmax',
                              expert_gate_up=[projection], expert_down=[projection], down_bias=torch.zeros(1, 16))
    with pytest.raises(RuntimeError, match='scale bytes'):
        native_gemms.Projection(kind='mxfp4', weight=torch.zeros(16, 1, 16, dtype=torch.uint8))
    norm = torch.ones(16, dtype=torch.bfloat16)
    layer = dict(input_norm=norm, post_norm=norm, qkv=projection, o=projection, gate_up=projection, down=projection,
                 rotary_dim=8)
    stack = dict(num_heads=2, num_kv_heads=1, head_dim=8, eps=1e-6, scale=0.25, quant_policy=0)
    native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, sinks=torch.zeros(2))], **stack)
    with pytest.raises(RuntimeError, match='one contiguous fp32 logit per query head'):
        native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, sinks=torch.zeros(3))], **stack)
