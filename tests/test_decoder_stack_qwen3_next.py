"""Qwen3-Next (MoE with a sigmoid-gated shared expert, Qwen3-Next's grouped in_proj_qkvz / in_proj_ba) and Qwen3.5
(dense MLP, four input projections) in the native decoder stack: its decode-only steps (Gated DeltaNet layers, gated
full attention with Gemma q/k norms and partial rotary) give the layers' own forward's hidden states and recurrent
states bit for bit, over sequences whose state slots are out of order; prefill and mixed steps keep the layers; each
part is shown to count."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB_SIZE, save_random_model
from helpers import random_prompts, run
from safetensors.torch import load_file
from test_decoder_stack import ENGINE
from transformers import Qwen3_5TextConfig, Qwen3NextConfig

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.models import qwen3_next
from lmdeploy.pytorch.nn.decoder_stack import NativeDecoderStack

# three linear-attention layers, then a full-attention one, twice; sizes the native GEMM's panels fit (b and a,
# the router and the shared-expert gate run on oneDNN)
SHAPE = dict(hidden_size=48, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=4, vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=False,
             pad_token_id=None)
VARIANTS = {
    'qwen3_5': lambda: Qwen3_5TextConfig(intermediate_size=64, **SHAPE),
    'qwen3_next': lambda: Qwen3NextConfig(intermediate_size=64, mlp_only_layers=[1], moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                          **SHAPE),
}
PROMPTS = random_prompts([20, 70, 9, 33], seed=8, vocab=250)
GEN = GenerationConfig(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    paths = {}

    def get(variant: str) -> str:
        if variant not in paths:
            paths[variant] = save_random_model(VARIANTS[variant](), str(tmp_path_factory.mktemp(variant)))
        return paths[variant]

    return get


@pytest.fixture
def stack_kernels(native_gemms):
    if cpu.gated_delta() is None:
        pytest.fail('the native gated delta rule builds wherever the native GEMMs (AVX-512) do')
    return native_gemms


def hybrid_engine(path: str) -> Engine:
    engine = Engine(path, PytorchEngineConfig(max_prefill_token_num=48, **ENGINE), show_progress=False)
    assert engine.runner.model.native_stack is not None and engine.runner.model.native_stack.decode_only
    return engine


def states(model, kv_caches) -> list[torch.Tensor]:
    return [pool for layer, cache in zip(model.layers, kv_caches) if layer.is_linear for pool in cache]


def compare_decode_steps(engine: Engine, monkeypatch) -> list[dict]:
    """Makes each decode-only step run through the stack and then, from the same recurrent states, through the
    layers, going on with the layers' results; records each such step's rows, state slots, and largest
    differences of hidden states and of the states left behind."""
    model = engine.runner.model
    stack, forward, steps = model.native_stack, model.forward, []

    def both(input_ids, kv_caches, ctx):
        if not stack.runs(input_ids.shape[0], ctx.num_prefill_tokens):
            return forward(input_ids, kv_caches, ctx)
        pools = states(model, kv_caches)
        before = [pool.clone() for pool in pools]
        stacked = forward(input_ids, kv_caches, ctx)
        after_stack = [pool.clone() for pool in pools]
        for pool, saved_pool in zip(pools, before):
            pool.copy_(saved_pool)
        model.native_stack = None
        try:
            layered = forward(input_ids, kv_caches, ctx)
        finally:
            model.native_stack = stack
        steps.append(dict(rows=input_ids.shape[0], slots=ctx.state_decode_slots.tolist(),
                          hidden=(stacked.float() - layered.float()).abs().max().item(),
                          states=max((a.float() - b.float()).abs().max().item() for a, b in zip(after_stack, pools))))
        return layered

    monkeypatch.setattr(model, 'forward', both)
    return steps


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_decode_steps_equal_the_layers(variant, saved, stack_kernels, monkeypatch):
    """Every decode-only step's hidden states and recurrent states from the stack equal the layers' exactly: four
    sequences, then the same four on slots handed back in another order; both runs give the same tokens, and
    every KV block and state slot comes back."""
    engine = hybrid_engine(saved(variant))
    steps = compare_decode_steps(engine, monkeypatch)
    first = run(engine, PROMPTS, GEN)
    second = run(engine, PROMPTS, GEN)
    assert first == second and [len(out) for out in first] == [8] * 4
    assert [step['hidden'] for step in steps] == [0.0] * len(steps)
    assert [step['states'] for step in steps] == [0.0] * len(steps)
    assert any(step['rows'] == 4 for step in steps)
    assert any(step['slots'] != sorted(step['slots']) for step in steps)
    pool = engine.scheduler.state_pool
    assert pool.num_free == pool.num_slots and not engine.sequences
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_only_decode_steps_run_in_the_stack(saved, stack_kernels, monkeypatch):
    """The engine runs decode-only steps in the stack and prefill and mixed steps (a prompt joining running
    sequences) in the layers, with the tokens of the layers alone."""
    engine = hybrid_engine(saved('qwen3_next'))
    model, calls, ran = engine.runner.model, [], []
    stack_call, forward = NativeDecoderStack.__call__, model.forward

    def counted(stack, x, kv_caches, ctx, local_rope=None):
        ran.append(ctx.num_prefill_tokens)
        return stack_call(stack, x, kv_caches, ctx, local_rope)

    def recorded(input_ids, kv_caches, ctx):
        calls.append((ctx.num_prefill_tokens, input_ids.shape[0]))
        return forward(input_ids, kv_caches, ctx)

    monkeypatch.setattr(NativeDecoderStack, '__call__', counted)
    monkeypatch.setattr(model, 'forward', recorded)
    prompts = random_prompts([20, 90, 9], seed=3, vocab=250)
    stacked = run(engine, prompts, GEN)
    assert any(0 < prefill < rows for prefill, rows in calls)
    assert ran == [0] * sum(prefill == 0 for prefill, _ in calls) and ran
    model.native_stack = None
    assert run(engine, prompts, GEN) == stacked


def qkv_without_gate(path: str, layer: int, native) -> SimpleNamespace:
    """Layer ``layer``'s q/k/v projection from the checkpoint with the output gate's rows zero (sigmoid 1/2), as a
    stand-in for the layer's ``Linear`` in ``layer_weights``."""
    weights = {}
    for name in os.listdir(path):
        if name.endswith('.safetensors'):
            weights.update(load_file(os.path.join(path, name)))
    prefix = f'model.layers.{layer}.self_attn.'
    q = weights[prefix + 'q_proj.weight'].view(4, 2, 16, -1).clone()
    q[:, 1] = 0
    stacked = torch.cat((q.flatten(0, 2), weights[prefix + 'k_proj.weight'], weights[prefix + 'v_proj.weight']))
    projection = native.Projection(kind='bf16', weight=native.pack_bf16_weight(stacked.bfloat16()))
    kernel = SimpleNamespace(native_projection=lambda bias: projection, small_step_projection=lambda bias: projection)
    return SimpleNamespace(kernel=kernel, bias=None)


def constant_z(native) -> SimpleNamespace:
    """A stand-in for in_proj_z giving z = 20 for every token (SiLU(z) = 20: no gate left)."""
    projection = native.Projection(kind='bf16', weight=native.pack_bf16_weight(torch.zeros(48, 48).bfloat16()),
                                   bias=torch.full((48,), 20.0).bfloat16())
    kernel = SimpleNamespace(router_projection=lambda bias: projection, small_step_rows=0)
    return SimpleNamespace(kernel=kernel, bias=None)


def rebuild_stack(model) -> None:
    attn = model.layers[3].self_attn
    model.native_stack = NativeDecoderStack.build([layer.native_weights() for layer in model.layers], None,
                                                  attn.num_heads, attn.num_kv_heads, attn.head_dim, model.norm.eps,
                                                  attn.attn.scale, 0, decode_only=True)


@pytest.mark.parametrize('part', ['gate', 'z_norm', 'conv', 'decay'])
def test_parts_matter(part, saved, stack_kernels, monkeypatch):
    """Each part counts: with it switched off in the stack alone (``gate``: the full-attention output gate at
    1/2; ``z_norm``: the gated norm's z fixed; ``conv``: the convolution reduced to its current-token tap of 1;
    ``decay``: a_log = -inf, no decay) the decode steps' hidden states differ from the layers'."""
    path = saved('qwen3_5')
    engine = hybrid_engine(path)
    model = engine.runner.model
    layer_weights, linear_attention_weights = qwen3_next.layer_weights, qwen3_next.linear_attention_weights

    def attention_without(input_norm, post_norm, projections, **options):
        if part == 'gate':
            projections['qkv'] = qkv_without_gate(path, 3, stack_kernels)
        return layer_weights(input_norm, post_norm, projections, **options)

    def linear_without(input_norm, post_norm, in_projections, projections, fields, **options):
        if part == 'z_norm':
            in_projections[1] = constant_z(stack_kernels)
        elif part == 'conv':
            fields['conv_weight'] = torch.zeros_like(fields['conv_weight'])
            fields['conv_weight'][:, -1] = 1
        elif part == 'decay':
            fields['a_log'] = torch.full_like(fields['a_log'], float('-inf'))
        return linear_attention_weights(input_norm, post_norm, in_projections, projections, fields, **options)

    monkeypatch.setattr(qwen3_next, 'layer_weights', attention_without)
    monkeypatch.setattr(qwen3_next, 'linear_attention_weights', linear_without)
    rebuild_stack(model)
    steps = compare_decode_steps(engine, monkeypatch)
    run(engine, PROMPTS[:2], GEN)
    differences = [step['hidden'] for step in steps]
    print(f'qwen3_5 without {part}: hidden states differ by up to {max(differences):.3g}')
    assert min(differences) > 0.01


def test_without_the_native_delta_rule_the_layers_run(saved, native_gemms, monkeypatch):
    """Without the native delta rule (a CPU without AVX-512) the model keeps its layers' forward, and serves."""
    monkeypatch.setattr(cpu, 'gated_delta', lambda: None)
    engine = Engine(saved('qwen3_5'), PytorchEngineConfig(**ENGINE), show_progress=False)
    assert engine.runner.model.native_stack is None
    assert [len(out) for out in run(engine, PROMPTS[:2], GEN)] == [8, 8]


def test_linear_attention_fields_are_checked(stack_kernels):
    """The stack's linear-attention layer takes its fields by name and checks them; it refuses prefill rows."""
    native = stack_kernels
    fields = dict(num_k_heads=2, num_v_heads=4, k_dim=8, v_dim=12, grouped_projections=False,
                  value_heads_tiled=False, conv_weight=torch.zeros(80, 4), a_log=torch.zeros(4),
                  dt_bias=torch.zeros(4), norm_weight=torch.ones(12), eps=1e-6)
    native.LinearAttention(**fields)
    for options, match in [(dict(num_v_heads=3), 'multiple of its key heads'),
                           (dict(conv_weight=torch.zeros(64, 4)), r'conv_weight is \[80, K\]'),
                           (dict(a_log=torch.zeros(2)), 'one value per value head'),
                           (dict(norm_weight=torch.ones(8)), 'spans a value head')]:
        with pytest.raises(RuntimeError, match=match):
            native.LinearAttention(**{**fields, **options})
    weight = native.pack_bf16_weight(torch.zeros(208, 48).bfloat16())
    projection = native.Projection(kind='bf16', weight=weight)
    norm = torch.ones(48, dtype=torch.bfloat16)
    layer = native.LayerWeights(input_norm=norm, post_norm=norm, qkv=projection, o=projection, gate_up=projection,
                                down=projection, rotary_dim=0, linear_attn=native.LinearAttention(**fields))
    stack = native.DecoderStack(layers=[layer], num_heads=4, num_kv_heads=2, head_dim=16, eps=1e-6, scale=0.25,
                                quant_policy=0)
    with pytest.raises(RuntimeError, match='no output gate'):
        native.DecoderStack(layers=[native.LayerWeights(input_norm=norm, post_norm=norm, qkv=projection, o=projection,
                                                        gate_up=projection, down=projection, rotary_dim=0,
                                                        output_gate=True,
                                                        linear_attn=native.LinearAttention(**fields))],
                            num_heads=4, num_kv_heads=2, head_dim=16, eps=1e-6, scale=0.25, quant_policy=0)
    empty = torch.zeros(0)
    step = native.StepTensors(cos=empty, sin=empty, kv_blocks=empty, kv_offsets=empty, num_prefill_tokens=1,
                              prefill_block_table=None, prefill_q_start=None, prefill_q_len=None,
                              prefill_ctx_len=None, prefill_max_q_len=1, decode_blocks=None, decode_kv_lens=None,
                              local_cos=None, local_sin=None, window_kv_blocks=None, window_prefill_block_table=None,
                              window_decode_blocks=None)
    with pytest.raises(RuntimeError, match='decode-only steps'):
        stack.forward(torch.zeros(1, 48, dtype=torch.bfloat16), [[torch.zeros(1, 80, 3), torch.zeros(1, 4, 8, 12)]],
                      step)
