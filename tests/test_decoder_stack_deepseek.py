"""DeepSeek-V3 in the native decoder stack: its multi-head latent attention (``LatentAttention`` of
``kernels/cpu/mla_layer.cpp``: with and without q_lora_rank, YaRN with its softmax mscale, rotary parts in
neighbouring pairs, over latent caches in bf16, int8 and int4), its dense first layer and its MoE layers
(``MoEBlock`` routed ``noaux_tc``) against the layers' own forward: every step's hidden states equal, and each part
of the attention shown to count."""
from __future__ import annotations

import pytest
import torch
from helpers import random_prompts, run
from test_decoder_stack import ENGINE, small_int4_steps, stack_differences
from test_decoder_stack_moe import run_checked
from test_deepseek import save_deepseek

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


@pytest.mark.parametrize('option', ['q_a_norm', 'kv_a_norm', 'interleaved_rope', 'softmax_mscale'])
def test_latent_attention_parts_matter(option, saved, native_gemms, monkeypatch):
    """Each part of the latent attention counts: a stack built without it gives other hidden states than the layers
    at every step, where the stack built with it gives theirs."""
    engine = deepseek_engine(saved['q_lora'])
    model = engine.runner.model
    prompts, gen = random_prompts([30, 20], seed=4), GenerationConfig(max_new_tokens=4, ignore_eos=True)
    with monkeypatch.context() as patch:
        differences = stack_differences(engine, patch)
        run(engine, prompts, gen)
    assert max(differences) == 0.0
    monkeypatch.setattr(deepseek_v3, 'latent_attention', latent_attention_without(option))
    attn = model.layers[0].self_attn
    model.native_stack = NativeDecoderStack.build([layer.native_weights() for layer in model.layers], None,
                                                  attn.num_heads, 1, attn.nope_dim + attn.rope_dim, model.norm.eps,
                                                  attn.attn.scale, 0)
    differences = stack_differences(engine, monkeypatch)
    run(engine, prompts, gen)
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


def test_v2_routing_keeps_the_layers(tmp_path, native_gemms):
    """DeepSeek-V2's group-limited softmax routing has no ``MoEBlock``: its layers keep their own forward, and
    serve."""
    engine = deepseek_engine(save_deepseek(str(tmp_path), 48, 'v2'))
    model = engine.runner.model
    assert model.native_stack is None and model.layers[1].self_attn.native_attention() is not None
    outs = run(engine, random_prompts([20, 9], seed=3), GenerationConfig(max_new_tokens=6, ignore_eos=True))
    assert [len(out) for out in outs] == [6, 6]
