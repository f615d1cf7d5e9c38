"""DeepSeek-V3 in the native decoder stack: its multi-head latent attention (``LatentAttention`` of
``kernels/cpu/mla_layer.cpp``: with and without q_lora_rank, YaRN with its softmax mscale, rotary parts in
neighbouring pairs, over latent caches in bf16, int8 and int4), its dense first layer and its MoE layers
(``MoEBlock`` routed ``noaux_tc``; DeepSeek-V2's ``greedy`` and ``group_limited_greedy``) against the layers' own
forward: every step's hidden states equal, and each part of the attention and of V2's routing shown to count."""
from __future__ import annotations

import pytest
import torch
from conftest import save_random_model
from helpers import random_prompts, run
from test_decoder_stack import ENGINE, small_int4_steps, stack_differences
from test_decoder_stack_moe import run_checked
from test_deepseek import ds_config, save_deepseek

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.models import deepseek_v3
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3MoE
from lmdeploy.pytorch.nn.decoder_stack import NativeDecoderStack, latent_attention

Q_LORA_RANKS = {'q_lora': 48, 'no_q_lora': None}


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """The tests' DeepSeek-V3 with and without q_lora_rank (a dense first layer, two MoE layers, YaRN), saved once."""
    return {name: save_deepseek(str(tmp_path_factory.mktemp(name)), rank) for name, rank in Q_LORA_RANKS.items()}


def deepseek_engine(path: str, **config) -> Engine:
    return Engine(path, PytorchEngineConfig(**{**ENGINE, 'max_prefill_token_num': 48, **config}), show_progress=False)


@pytest.mark.parametrize('variant,quant_policy', [('q_lora', 0), ('no_q_lora', 0), ('q_lora', 8), ('no_q_lora', 4)])
def test_deepseek_stack_equals_the_layers(variant, quant_policy, saved, native_gemms, monkeypatch):
    """Every layer in the stack (the latent attention, the dense first layer, the MoE layers), equal to the layers'
    forward at every step: chunked prefills of 48 tokens, mixed and decode steps, over a bf16, int8 or int4 latent
    cache; batched equal to solo, and every block given back."""
    engine = deepseek_engine(saved[variant], quant_policy=quant_policy)
    model = engine.runner.model
    assert model.native_stack is not None
    blocks = [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]
    assert len(blocks) == 2 and all(block.native_moe() is not None for block in blocks)
    steps = run_checked(engine, monkeypatch)
    assert any(0 < prefill < rows for prefill, rows in steps) and any(prefill == 0 for prefill, _ in steps)
    assert any(prefill == rows == 48 for prefill, rows in steps) and (0, 1) in steps
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences


def test_small_int4_steps_run_in_the_stack(saved, native_gemms, monkeypatch):
    """With ``decode_int4`` and the native int4 GEMV, steps of at most two tokens run in the stack on the 4-bit copies
    (o_proj's and the dense MLP's; the latent attention's other projections have none), equal to the layers'
    forward on them."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    engine = Engine(saved['q_lora'], PytorchEngineConfig(decode_int4=True, **ENGINE), show_progress=False)
    stack = engine.runner.model.native_stack
    assert stack.small is not None and stack.small_step_rows == 2
    steps = small_int4_steps(engine, monkeypatch)
    assert (0, 1) in steps and (0, 3) in steps


def latent_attention_without(option: str):
    """``latent_attention`` with one of its parts changed: a q_a or kv_a norm of unit weight, the rotary parts in
    halves instead of neighbouring pairs, or the softmax scale without YaRN's mscale."""

    def build(projections, small_step=False, **options):
        if option in ('q_a_norm', 'kv_a_norm'):
            options[option] = torch.ones_like(options[option])
        elif option == 'interleaved_rope':
            assert options[option]
            options[option] = False
        else:
            plain = (options['nope_dim'] + options['rope_dim'])**-0.5
            assert options['scale'] > 1.2 * plain  # YaRN's factor 4 scales it by 1.3
            options['scale'] = plain
        return latent_attention(projections, small_step, **options)

    return build


def run_differences(engine, monkeypatch, prompts, gen, rebuilt: bool = False) -> list[float]:
    """Each step's largest difference between the stack's and the layers' hidden states over ``prompts``; with
    ``rebuilt``, of a stack built again from the layers' weights (as patched), the patches kept."""
    if not rebuilt:
        with monkeypatch.context() as patch:
            differences = stack_differences(engine, patch)
            run(engine, prompts, gen)
        return differences
    model = engine.runner.model
    attn = model.layers[0].self_attn
    model.native_stack = NativeDecoderStack.build([layer.native_weights() for layer in model.layers], None,
                                                  attn.num_heads, 1, attn.nope_dim + attn.rope_dim, model.norm.eps,
                                                  attn.attn.scale, 0)
    differences = stack_differences(engine, monkeypatch)
    run(engine, prompts, gen)
    return differences


@pytest.mark.parametrize('option', ['q_a_norm', 'kv_a_norm', 'interleaved_rope', 'softmax_mscale'])
def test_latent_attention_parts_matter(option, saved, native_gemms, monkeypatch):
    """Each part of the latent attention counts: a stack built without it gives other hidden states than the layers
    at every step, where the stack built with it gives theirs."""
    engine = deepseek_engine(saved['q_lora'])
    prompts, gen = random_prompts([30, 20], seed=4), GenerationConfig(max_new_tokens=4, ignore_eos=True)
    assert max(run_differences(engine, monkeypatch, prompts, gen)) == 0.0
    monkeypatch.setattr(deepseek_v3, 'latent_attention', latent_attention_without(option))
    differences = run_differences(engine, monkeypatch, prompts, gen, rebuilt=True)
    print(f'deepseek without {option}: hidden states differ by {min(differences):.3g} to {max(differences):.3g}')
    assert min(differences) > 0.005  # the mscale's least: about 0.01 (a 1.3x softmax scale on a tiny model)


def test_latent_attention_fields_are_checked(native_gemms):
    """The latent attention's weights go by name and are checked; a layer has a qkv projection or an mla block."""
    weight = native_gemms.pack_bf16_weight(torch.zeros(32, 16, dtype=torch.bfloat16))
    projection = native_gemms.Projection(kind='bf16', weight=weight)
    fields = dict(q=projection, kv_a=projection, kv_a_norm=torch.ones(8), kv_b=torch.zeros(2 * (4 + 4), 8),
                  num_heads=2, kv_lora_rank=8, nope_dim=4, rope_dim=4, v_head_dim=4, interleaved_rope=True,
                  scale=0.3, norm_eps=1e-6)
    mla = native_gemms.LatentAttention(**fields)
    for options, match in [(dict(q_a=projection), 'q_a and q_a_norm come together'),
                           (dict(kv_b=torch.zeros(12, 8)), r"kv_b is kv_b_proj's dense weight"),
                           (dict(kv_a_norm=torch.ones(4)), r'kv_a_norm is \[kv_lora_rank\]'),
                           (dict(rope_dim=3), 'even rope_dim')]:
        with pytest.raises(RuntimeError, match=match):
            native_gemms.LatentAttention(**{**fields, **options})
    with pytest.raises(TypeError):
        native_gemms.LatentAttention(**{**fields, 'kv_b_weight': torch.zeros(16, 8)})
    norm = torch.ones(16, dtype=torch.bfloat16)
    layer = dict(input_norm=norm, post_norm=norm, o=projection, gate_up=projection, down=projection, rotary_dim=0)
    stack = dict(num_heads=2, num_kv_heads=1, head_dim=8, eps=1e-6, scale=0.25, quant_policy=0)
    native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, mla=mla)], **stack)
    for options in (dict(), dict(mla=mla, qkv=projection), dict(mla=mla, rotary_dim=4)):
        with pytest.raises(RuntimeError, match='qkv projection or its mla block|an mla layer has none'):
            native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**{**layer, **options})], **stack)


def save_v2(path: str, routing: str) -> str:
    """The tests' DeepSeek-V2 (8 experts in 2 groups, top-2 from the best group, routed_scaling_factor 2) routed
    ``routing`` (its ``topk_method``)."""
    config = ds_config(48, 'v2')
    config.topk_method = routing
    return save_random_model(config, path)


@pytest.mark.parametrize('routing', ['greedy', 'group_limited_greedy'])
def test_v2_stack_equals_the_layers(routing, tmp_path, native_gemms, monkeypatch):
    """DeepSeek-V2's routings as MoE blocks (softmax top-k over every expert, ``greedy``, or over the best groups',
    ``group_limited_greedy``; times the scaling factor, never renormalized): every layer in the stack, equal to the
    layers' forward at every step, batched equal to solo, every block given back."""
    engine = deepseek_engine(save_v2(str(tmp_path), routing))
    model = engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]
    assert model.native_stack is not None and [block.routing for block in blocks] == [routing] * 2
    assert all(block.native_moe() is not None for block in blocks)
    steps = run_checked(engine, monkeypatch)
    assert any(0 < prefill < rows for prefill, rows in steps) and (0, 1) in steps
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences


@pytest.mark.parametrize('change', ['no_group_limit', 'no_scaling'])
def test_v2_routing_parts_matter(change, tmp_path, native_gemms, monkeypatch):
    """Each part of ``group_limited_greedy`` counts: MoE blocks routing without the group limit (``greedy``) or
    without the scaling factor give other hidden states than the layers, where the blocks as built give theirs."""
    engine = deepseek_engine(save_v2(str(tmp_path), 'group_limited_greedy'))
    prompts, gen = random_prompts([30, 20], seed=4), GenerationConfig(max_new_tokens=4, ignore_eos=True)
    assert max(run_differences(engine, monkeypatch, prompts, gen)) == 0.0
    moe_block = native_gemms.MoEBlock

    def changed(**fields):
        if change == 'no_group_limit':
            del fields['num_groups'], fields['topk_groups']
            return moe_block(**{**fields, 'routing': 'greedy'})
        return moe_block(**{**fields, 'scaling': 1.0})

    monkeypatch.setattr(native_gemms, 'MoEBlock', changed)
    differences = run_differences(engine, monkeypatch, prompts, gen, rebuilt=True)
    print(f'deepseek-v2 with {change}: hidden states differ by {min(differences):.3g} to {max(differences):.3g}')
    assert min(differences) > 0.005


def test_v2_routing_fields_are_checked(native_gemms):
    """``greedy`` takes the scaling alone, ``group_limited_greedy`` the groups too; neither a correction bias nor
    renormalization; the groups split the experts evenly and hold top_k."""
    weight = torch.zeros(32, 16, dtype=torch.bfloat16)
    proj = native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_weight(weight))
    experts = dict(gate_up=torch.zeros(4, 32, 16, dtype=torch.bfloat16),
                   down=torch.zeros(4, 16, 16, dtype=torch.bfloat16))
    block = dict(router=proj, top_k=2, renormalize=False, scaling=2.0, **experts)
    groups = dict(num_groups=2, topk_groups=1)
    native_gemms.MoEBlock(routing='greedy', **block)
    native_gemms.MoEBlock(routing='group_limited_greedy', **groups, **block)
    native_gemms.MoEBlock(routing='group_limited_greedy', **{**groups, 'num_groups': 4, 'topk_groups': 2}, **block)
    for options, match in [(dict(routing='greedy', **groups), 'do not renormalize'),
                           (dict(routing='greedy', scaling=None), 'do not renormalize'),
                           (dict(routing='greedy', renormalize=True), 'do not renormalize'),
                           (dict(routing='greedy', correction_bias=torch.zeros(4)), 'do not renormalize'),
                           (dict(routing='group_limited_greedy'), 'do not renormalize'),
                           (dict(routing='group_limited_greedy', **groups, norm_min=1e-12), 'do not renormalize'),
                           (dict(routing='group_limited_greedy', **{**groups, 'num_groups': 3}), 'equal groups'),
                           (dict(routing='group_limited_greedy', **{**groups, 'topk_groups': 3}), 'topk_groups is 1'),
                           (dict(routing='group_limited_greedy', **{**groups, 'num_groups': 4}, top_k=2),
                            'hold top_k')]:
        with pytest.raises(RuntimeError, match=match):
            native_gemms.MoEBlock(**{**block, **options})
