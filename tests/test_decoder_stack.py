"""The native decoder stack (``nn/decoder_stack.py``) against the layers' own forward, for every family that
runs through it, on bf16 and W8A8 projections (and for small steps the 4-bit ones of ``decode_int4``), over
KV caches in the model dtype, int8 and int4: each step's hidden states are equal, over chunked prefills,
mixed and decode steps (MoE families: test_decoder_stack_moe.py)."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import pytest
import torch
from conftest import save_tiny_model
from helpers import random_prompts, run
from safetensors.torch import load_file, save_file
from test_model_families import save_family

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.w8a8 import quantize_weight
from lmdeploy.pytorch.models import olmo
from lmdeploy.pytorch.nn.decoder_stack import NativeDecoderStack, layer_weights


def save_qwen2_windowed(kind: str, path: str) -> str:
    """A tiny Qwen2 whose second layer attends over a 16-token sliding window, its first over everything."""
    return save_tiny_model('qwen2', path, sliding_window=16, use_sliding_window=True,
                           layer_types=['full_attention', 'sliding_attention'])


# the families whose layers run in the stack, and how to save a tiny random model of each: SmolLM3 with a
# layer without rotary, Phi-4-mini's partial rotary (phi3_longrope), Mistral with a 16-token sliding window
# in every layer, Qwen2 with one in one layer, GLM's rotary over interleaved pairs of half of each head,
# GLM-4's norms on the outputs of attention and the MLP, and Gemma 2 (Gemma's sandwich norms, GeLU MLP, query
# scale, soft-capped scores, local and global layers), Gemma 3 (q/k Gemma norms, local layers on their own
# rotary table), Ministral 3 (queries scaled by their position), Seed-OSS (q/k/v biases without an o_proj one),
# ERNIE 4.5 (rotary over interleaved pairs of the whole head, biases on every projection), Granite (outputs
# scaled by its residual multiplier, its attention multiplier as the score scale), OLMo 2 (post-norms only, q/k
# norms over all heads) and OLMo 3 (with sliding layers on their own rotary table and a YaRN global layer)
STACK_FAMILIES = {'llama': save_tiny_model, 'qwen2': save_tiny_model, 'qwen3': save_tiny_model,
                  'mistral': save_family, 'phi3': save_family, 'smollm3': save_family, 'phi3_longrope': save_family,
                  'mistral_sliding': save_family, 'qwen2_windowed': save_qwen2_windowed, 'glm': save_family,
                  'glm4': save_family, 'gemma2': save_family, 'gemma3': save_family, 'ministral3': save_family,
                  'seed_oss': save_family, 'ernie4_5': save_family, 'granite': save_family, 'olmo2': save_family,
                  'olmo3': save_family}
CASES = [(kind, 'bf16', 0) for kind in STACK_FAMILIES] + [(kind, 'w8a8', 8) for kind in STACK_FAMILIES]
CASES += [('llama', 'bf16', 8), ('llama', 'bf16', 4), ('llama', 'w8a8', 0), ('qwen3', 'w8a8', 4)]
ENGINE = dict(dtype='bfloat16', num_gpu_blocks=64, block_size=16, enable_prefix_caching=False)


def save_w8a8(source: str, out: str) -> str:
    """``source`` with each decoder projection (fused ones too, and linear attention's ``in_proj_*``) quantized to
    int8 with per-row scales, as a ``smooth_quant`` checkpoint (without smoothing, which changes nothing the engine
    does)."""
    state = {}
    for name in os.listdir(source):
        if name.endswith('.safetensors'):
            state.update(load_file(os.path.join(source, name)))
    quantized = {}
    for name, tensor in state.items():
        if name.startswith('model.layers.') and re.search(r'_proj(_[a-z]+)?\.weight$', name):
            quantized[name], quantized[name.removesuffix('weight') + 'scale'] = quantize_weight(tensor.float())
        else:
            quantized[name] = tensor
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(source):
        if not name.endswith(('.safetensors', '.safetensors.index.json')):
            with open(os.path.join(source, name), 'rb') as src, open(os.path.join(out, name), 'wb') as dst:
                dst.write(src.read())
    save_file({k: v.contiguous() for k, v in quantized.items()}, os.path.join(out, 'model.safetensors'))
    with open(os.path.join(out, 'config.json')) as f:
        config = json.load(f)
    config['quantization_config'] = {'quant_method': 'smooth_quant', 'quant_dtype': 'int8'}
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """A tiny random model of a family, and its W8A8 copy, saved once per family and weight kind."""
    return saved_models(tmp_path_factory, lambda kind, folder: STACK_FAMILIES[kind](kind, folder))


def saved_models(tmp_path_factory, save: Callable[[str, str], str]) -> Callable[[str, str], str]:
    """``get(kind, weights)``: the model ``save(kind, folder)`` writes (``weights`` 'bf16'), or its W8A8 copy
    ('w8a8'), each saved once."""
    paths = {}

    def get(kind: str, weights: str) -> str:
        if (kind, 'bf16') not in paths:
            paths[kind, 'bf16'] = save(kind, str(tmp_path_factory.mktemp(kind)))
        if (kind, weights) not in paths:
            paths[kind, weights] = save_w8a8(paths[kind, 'bf16'], str(tmp_path_factory.mktemp(f'{kind}_w8a8')))
        return paths[kind, weights]

    return get


def check_every_step(engine: Engine, monkeypatch) -> list[tuple[int, int]]:
    """Makes each of ``engine``'s steps run through the stack and then through the layers, asserting equal
    hidden states (the cache rows the second run writes are the first's); returns the (prefill tokens, rows)
    of the steps that ran in the stack."""
    model = engine.runner.model
    stack, forward, steps = model.native_stack, model.forward, []

    def both(input_ids, kv_caches, ctx):
        stacked = forward(input_ids, kv_caches, ctx)
        if stack.runs(input_ids.shape[0]):
            steps.append((ctx.num_prefill_tokens, input_ids.shape[0]))
        model.native_stack = None
        try:
            layered = forward(input_ids, kv_caches, ctx)
        finally:
            model.native_stack = stack
        assert torch.equal(stacked, layered)
        return stacked

    monkeypatch.setattr(model, 'forward', both)
    return steps


def assert_stack_equals_the_layers(path: str, quant_policy: int, monkeypatch) -> None:
    """Chunked prefills (48 tokens a step), mixed and decode steps of four prompts: each step's stack output equal
    to the layers' own (:func:`check_every_step`)."""
    engine = Engine(path, PytorchEngineConfig(max_prefill_token_num=48, quant_policy=quant_policy, **ENGINE),
                    show_progress=False)
    assert engine.runner.model.native_stack is not None
    steps = check_every_step(engine, monkeypatch)
    outs = run(engine, random_prompts([20, 70, 9, 33], seed=8), GenerationConfig(max_new_tokens=12, ignore_eos=True))
    assert [len(out) for out in outs] == [12] * 4
    assert any(0 < prefill < rows for prefill, rows in steps) and any(prefill == 0 for prefill, _ in steps)


@pytest.mark.parametrize('kind,weights,quant_policy', CASES)
def test_stack_equals_the_layers(kind, weights, quant_policy, saved, native_gemms, monkeypatch):
    assert_stack_equals_the_layers(saved(kind, weights), quant_policy, monkeypatch)


def small_int4_steps(engine: Engine, monkeypatch) -> list[tuple[int, int]]:
    """Runs one prompt, then three, through ``engine`` (``decode_int4`` on), every step checked by
    :func:`check_every_step`; returns the (prefill tokens, rows) of the steps that ran in the stack."""
    steps = check_every_step(engine, monkeypatch)
    prompts = random_prompts([20, 70, 9], seed=8)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    run(engine, prompts[:1], gen)
    run(engine, prompts, gen)
    return steps


@pytest.mark.parametrize('kind', ['llama', 'qwen2', 'qwen3', 'smollm3', 'mistral_sliding', 'glm4', 'gemma3',
                                  'ministral3', 'olmo3'])
def test_small_int4_steps_run_in_the_stack(kind, saved, native_gemms, monkeypatch):
    """With ``decode_int4`` and the native int4 GEMV, steps of at most two tokens run in the stack on the
    4-bit weights (qwen2: with the qkv bias; qwen3: q and k norms; smollm3: a layer without rotary;
    mistral_sliding: a sliding window; glm4: interleaved partial rotary, output norms; gemma3: the GeLU MLP on
    plain 4-bit gate and up rows, local rotary; ministral3: queries scaled by their position; olmo3: post-norms
    only, q/k norms over all heads, sliding layers on their own rotary), equal to the layers' forward on them."""
    assert_small_int4_steps_run_in_the_stack(saved(kind, 'bf16'), monkeypatch)


def assert_small_int4_steps_run_in_the_stack(path: str, monkeypatch) -> None:
    """With ``decode_int4``, the model at ``path`` runs its decode steps of one and of three rows in the stack on
    the 4-bit weights, each equal to the layers' forward (:func:`small_int4_steps`; skipped without the native int4
    GEMV)."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    engine = Engine(path, PytorchEngineConfig(decode_int4=True, **ENGINE), show_progress=False)
    stack = engine.runner.model.native_stack
    assert stack.small is not None and stack.small_step_rows == 2
    steps = small_int4_steps(engine, monkeypatch)
    assert (0, 1) in steps and (0, 3) in steps


def test_small_steps_without_int4_gemv_run_on_torchs_int4_kernel(saved, native_gemms, monkeypatch):
    """Without the native int4 GEMV (AVX2) the 4-bit copies run on torch's kernel, which the stack runs too
    (``int4_torch`` projections): small steps run in the stack on them, equal to the layers'."""
    monkeypatch.setattr(cpu, 'int4_gemv', lambda: None)
    engine = Engine(saved('llama', 'bf16'), PytorchEngineConfig(decode_int4=True, **ENGINE), show_progress=False)
    assert engine.runner.model.native_stack.small is not None
    steps = small_int4_steps(engine, monkeypatch)
    assert (0, 1) in steps and (0, 3) in steps


def test_int4_gate_up_with_bias_keeps_the_layers(tmp_path, native_gemms, monkeypatch):
    """A gate-and-up bias has no place in the int4 GEMV's SiLU epilogue: small steps keep the layers."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    path = save_tiny_model('llama', str(tmp_path), mlp_bias=True)
    engine = Engine(path, PytorchEngineConfig(decode_int4=True, **ENGINE), show_progress=False)
    assert engine.runner.model.native_stack.small is None
    steps = small_int4_steps(engine, monkeypatch)
    assert all(rows > 2 for _, rows in steps)


def test_fields_are_named(native_gemms):
    """The stack's weights and step tensors go by name: a name left out, misspelt or of the wrong kind raises, and so
    do a layer's options that do not fit together."""
    weight = torch.zeros(32, 16, dtype=torch.bfloat16)
    bf16 = native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_weight(weight))
    norm = torch.ones(16, dtype=torch.bfloat16)
    layer = dict(input_norm=norm, post_norm=norm, qkv=bf16, o=bf16, gate_up=bf16, down=bf16, rotary_dim=16)
    native_gemms.LayerWeights(**layer)
    with pytest.raises(TypeError):
        native_gemms.LayerWeights(**{k: v for k, v in layer.items() if k != 'o'})
    with pytest.raises(TypeError):
        native_gemms.LayerWeights(**layer, v_norm=norm)
    with pytest.raises(TypeError):
        native_gemms.LayerWeights(*layer.values())
    stack = dict(num_heads=1, num_kv_heads=1, head_dim=16, eps=1e-6, scale=0.25, quant_policy=0)
    native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, sliding_window=8)], **stack)
    across = dict(q_norm=norm, k_norm=norm, qk_norm_across_heads=True)
    native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, **across)], **stack)
    post_only = {**layer, 'input_norm': None, 'post_norm': None, 'post_norms_only': True}
    native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**post_only, attn_out_norm=norm, mlp_out_norm=norm)],
                              **stack)
    native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, attention_chunk=8, qk_l2_norm_eps=1e-5)],
                              **stack)
    for options, match in [(dict(rotary_dim=18), 'from 0 to head_dim'), (dict(rotary_dim=7), 'even'),
                           (dict(sliding_window=0), 'window is positive'),
                           (dict(q_norm=norm[:8], k_norm=norm[:8]), 'span a head, or all heads'),
                           (dict(qk_norm_across_heads=True), 'needs the q and k norms'),
                           (dict(post_norm=None), 'its input_norm and post_norm'),
                           (dict(post_norms_only=True, attn_out_norm=norm, mlp_out_norm=norm), 'no input_norm'),
                           ({**post_only, 'attn_out_norm': norm}, 'has attn_out_norm and mlp_out_norm'),
                           ({**post_only, 'attn_out_norm': norm, 'mlp_out_norm': norm, 'residual_scale': 0.5},
                            'nor residual_scale'),
                           (dict(attention_chunk=0), 'attention chunk is positive'),
                           (dict(attention_chunk=8, sliding_window=8), 'no sliding window with it'),
                           (dict(qk_l2_norm_eps=1e-5, q_norm=norm, k_norm=norm), 'no q and k norms with it')]:
        with pytest.raises(RuntimeError, match=match):
            native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**{**layer, **options})], **stack)
    with pytest.raises(RuntimeError, match="a projection's kind is 'bf16', .*'mxfp4_dequantized', not 'int2'"):
        native_gemms.Projection(kind='int2', weight=weight)
    with pytest.raises(RuntimeError, match='scale bytes'):
        native_gemms.Projection(kind='q4k', weight=weight.to(torch.uint8), scale=torch.ones(32).half())
    with pytest.raises(RuntimeError, match='two or more'):
        native_gemms.Projection(parts=[bf16])
    with pytest.raises(RuntimeError, match='codes and scales'):
        native_gemms.Projection(kind='q6k', weight=weight.to(torch.uint8))
    with pytest.raises(RuntimeError, match='fp16 scales'):
        native_gemms.Projection(kind='int4', weight=weight.to(torch.uint8), scale=torch.ones(32))
    with pytest.raises(RuntimeError, match='without compensation or scale'):
        native_gemms.Projection(kind='bf16', weight=weight, scale=torch.ones(32))
    with pytest.raises(RuntimeError, match='compensation and scale'):
        native_gemms.Projection(kind='w8a8', weight=weight.to(torch.int8))
    step = dict(cos=weight, sin=weight, kv_blocks=weight, kv_offsets=weight, num_prefill_tokens=0,
                prefill_block_table=None, prefill_q_start=None, prefill_q_len=None, prefill_ctx_len=None,
                prefill_max_q_len=0, decode_blocks=None, decode_kv_lens=None, local_cos=None, local_sin=None,
                window_kv_blocks=None, window_prefill_block_table=None, window_decode_blocks=None)
    native_gemms.StepTensors(**step)
    with pytest.raises(TypeError):
        native_gemms.StepTensors(**{**step, 'decode_kv_len': step.pop('decode_kv_lens')})


def stack_differences(engine: Engine, monkeypatch) -> list[float]:
    """Makes each of ``engine``'s steps run through the stack and then through the layers, going on with the
    layers' hidden states (and the cache rows they write); returns the largest difference of each step's."""
    model = engine.runner.model
    stack, forward, differences = model.native_stack, model.forward, []

    def both(input_ids, kv_caches, ctx):
        stacked = forward(input_ids, kv_caches, ctx)
        model.native_stack = None
        try:
            layered = forward(input_ids, kv_caches, ctx)
        finally:
            model.native_stack = stack
        differences.append((stacked.float() - layered.float()).abs().max().item())
        return layered

    monkeypatch.setattr(model, 'forward', both)
    return differences


def differences_without_an_option(engine: Engine, monkeypatch, module, weights_without,
                                  prompts: list[list[int]]) -> list[float]:
    """Each step's hidden-state differences from the layers with the stack rebuilt by ``weights_without`` in place
    of ``module.layer_weights`` (after checking that the stack as built gives the layers' states exactly)."""
    model = engine.runner.model
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    with monkeypatch.context() as patch:
        differences = stack_differences(engine, patch)
        run(engine, prompts, gen)
    assert max(differences) == 0.0
    monkeypatch.setattr(module, 'layer_weights', weights_without)
    attn = model.layers[0].self_attn
    model.native_stack = NativeDecoderStack.build([layer.native_weights() for layer in model.layers], None,
                                                  attn.num_heads, attn.num_kv_heads, attn.head_dim, model.norm.eps,
                                                  attn.attn.scale, 0)
    differences = stack_differences(engine, monkeypatch)
    run(engine, prompts, gen)
    return differences


@pytest.mark.parametrize('kind', ['olmo2', 'olmo3'])
@pytest.mark.parametrize('option', ['qk_norm_across_heads', 'post_norms_only'])
def test_olmo_options_matter(kind, option, saved, native_gemms, monkeypatch):
    """Each of OLMo's options counts: a stack built without it (``qk_norm_across_heads``: without the q/k norms;
    ``post_norms_only``: the pre-norm arrangement with unit input and post-attention norms, the output norms kept)
    gives other hidden states than the layers at every step, where the stack built with it gives theirs."""
    engine = Engine(saved(kind, 'bf16'), PytorchEngineConfig(**ENGINE), show_progress=False)

    def without_option(input_norm, post_norm, projections, small_step=False, **options):
        options[option] = False
        if option == 'qk_norm_across_heads':
            del options['q_norm'], options['k_norm']
        else:
            input_norm = post_norm = torch.ones_like(options['attn_out_norm'])
        return layer_weights(input_norm, post_norm, projections, small_step, **options)

    differences = differences_without_an_option(engine, monkeypatch, olmo, without_option,
                                                random_prompts([20, 9], seed=4))
    print(f'{kind} without {option}: hidden states differ by {min(differences):.3g} to {max(differences):.3g}')
    assert min(differences) > 0.01
