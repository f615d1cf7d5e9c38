"""MoE families (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, GLM-4.5 with DeepSeek-V3's grouped routing,
ERNIE 4.5 MoE with its biased softmax routing) in the native decoder stack: the stack's ``MoEBlock``
(``kernels/cpu/moe_block.cpp``) against ``SparseMoeBlock``'s, ``DeepseekV3MoE``'s and ``Ernie4_5MoE``'s forward, on
dense bf16 experts and on a GGUF file's Q4_K, Q6_K and Q8_0 experts: every step's hidden states are equal, over
chunked prefills, mixed and decode steps (Llama 4: test_decoder_stack_llama4.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model
from gguf import GGMLQuantizationType as Q
from helpers import random_prompts, run
from test_decoder_stack import ENGINE, check_every_step
from test_glm4_moe import VARIANTS, save_glm4_moe
from test_gguf_glm4moe import write_k_quant_glm4_moe
from test_gguf_mixed import write_mixed_gguf
from test_gguf_moe import FILES
from test_model_families import save_family

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3MoE
from lmdeploy.pytorch.models.ernie import Ernie4_5MoE
from lmdeploy.pytorch.models.moe import SparseMoeBlock
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant.cpu_bf16 import NativeBf16Kernel
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.nn.quant.q6k_cpu import KQuantDequantized, Q6KGemv
from lmdeploy.pytorch.weights.gguf import convert_gguf

# a tiny model of each family, and Qwen3-MoE with 16 experts, whose router runs on the native GEMM's 16-row panels
MOE_MODELS = {'mixtral': ('mixtral', {}), 'qwen2_moe': ('qwen2_moe', {}), 'qwen3_moe': ('qwen3_moe', {}),
              'qwen3_moe_16': ('qwen3_moe', dict(num_experts=16))}
# GGUF files whose experts all run on native GEMVs (decode rows; prefill rows dequantized per call):
# Q4_K and a Q6_K down in one layer (Qwen2-MoE: its shared expert's down too), a Q5_K down in Mixtral's
NATIVE_FILES = {'qwen3_moe': {'blk.0.ffn_down_exps': Q.Q6_K, 'default': Q.Q4_K},
                'qwen2_moe': FILES['qwen2_moe'][0], 'mixtral': {'blk.1.ffn_down_exps': Q.Q5_K, 'default': Q.Q4_K},
                'glm4_moe': {'blk.1.ffn_down_exps': Q.Q6_K, 'blk.2.ffn_down_shexp': Q.Q6_K, 'default': Q.Q4_K}}


def moe_blocks(engine: Engine) -> list[SparseMoeBlock | DeepseekV3MoE | Ernie4_5MoE]:
    return [m for m in engine.runner.model.modules() if isinstance(m, (SparseMoeBlock, DeepseekV3MoE, Ernie4_5MoE))]


def save_moe(kind: str, path: str) -> str:
    """A tiny random model of ``kind``: a MoE family of ``conftest``'s, or GLM-4.5 (``glm4_moe``: two groups of
    experts of which one is chosen, a correction bias, a routed scaling of 2.5, attention biases), or ERNIE 4.5 MoE
    (``ernie4_5_moe``: a dense first layer, then two MoE layers of four experts, two per token, and a shared one)."""
    if kind == 'glm4_moe':
        return save_glm4_moe(path, **VARIANTS['glm45'])
    return save_family(kind, path) if kind == 'ernie4_5_moe' else save_tiny_model(kind, path)


def run_checked(engine: Engine, monkeypatch, batched_equals_solo: bool = True) -> list[tuple[int, int]]:
    """Four prompts through ``engine`` together, then each alone, each step through the stack and the layers
    with equal hidden states (see :func:`check_every_step`); with ``batched_equals_solo``, the same tokens both
    ways (not where a step's size picks the weights: ``decode_int4``'s 4-bit copies, or GGUF Q4_K's kernels by an
    expert's share of it). Returns the (prefill tokens, rows) of the steps that ran in the stack."""
    steps = check_every_step(engine, monkeypatch)
    prompts = random_prompts([20, 70, 9, 33], seed=8, vocab=250)
    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    batched = run(engine, prompts, gen)
    solo = [run(engine, [prompt], gen)[0] for prompt in prompts]
    assert [len(out) for out in batched] == [10] * 4
    if batched_equals_solo:
        assert batched == solo
    return steps


def assert_two_moe_layers_in_the_stack(path: str, monkeypatch) -> None:
    """The model at ``path`` runs every layer in the stack, its two MoE layers as ``MoEBlock``s, equal to the layers'
    forward at every step: chunked prefills of 48 tokens, mixed and decode steps."""
    engine = Engine(path, PytorchEngineConfig(max_prefill_token_num=48, **ENGINE), show_progress=False)
    assert engine.runner.model.native_stack is not None
    blocks = moe_blocks(engine)
    assert len(blocks) == 2 and all(block.native_moe() is not None for block in blocks)
    steps = run_checked(engine, monkeypatch)
    assert any(0 < prefill < rows for prefill, rows in steps) and any(prefill == 0 for prefill, _ in steps)
    assert any(prefill == rows == 48 for prefill, rows in steps) and (0, 1) in steps


@pytest.mark.parametrize('model', sorted(MOE_MODELS))
def test_bf16_moe_stack_equals_the_layers(model, tmp_path, native_gemms, monkeypatch):
    """Dense bf16 experts (``fused_moe``), the router on the native GEMM, its panels padded where its outputs do not
    fill them (4 experts) and whole (16), Qwen2-MoE's shared-expert gate (one output) padded alike, Qwen2-MoE's
    dense layer beside its MoE layers."""
    kind, overrides = MOE_MODELS[model]
    engine = Engine(save_tiny_model(kind, str(tmp_path), **overrides),
                    PytorchEngineConfig(max_prefill_token_num=48, **ENGINE), show_progress=False)
    assert engine.runner.model.native_stack is not None
    blocks = moe_blocks(engine)
    assert all(block.native_moe() is not None for block in blocks)
    assert all(isinstance(block.gate.kernel, NativeBf16Kernel) for block in blocks)
    steps = run_checked(engine, monkeypatch)
    assert any(0 < prefill < rows for prefill, rows in steps) and any(prefill == 0 for prefill, _ in steps)
    assert any(prefill == rows == 48 for prefill, rows in steps) and (0, 1) in steps


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_glm45_stack_equals_the_layers(variant, tmp_path, native_gemms, monkeypatch):
    """GLM-4.5 (``glm45``: q/k/v biases, two groups of four experts of which one is chosen, a routed scaling of 2.5;
    ``glm45_air_qk_norm``: q/k norms, one group), its dense first layer and partial rotary: every layer in the
    stack, the MoE layers as ``MoEBlock``s routed ``noaux_tc`` (fp32 router, ungated shared expert), equal to the
    layers' forward at every step."""
    assert_two_moe_layers_in_the_stack(save_glm4_moe(str(tmp_path), **VARIANTS[variant]), monkeypatch)


def glm45_blocks(path: str) -> list[DeepseekV3MoE]:
    """The MoE blocks of a bf16 engine on GLM-4.5 at ``path``, on the native GEMMs."""
    return moe_blocks(Engine(path, PytorchEngineConfig(**ENGINE), show_progress=False))


@pytest.mark.parametrize('tokens', [1, 5, 40])
def test_glm45_block_equals_the_python_forward(tokens, tmp_path, native_gemms):
    """GLM-4.5's ``MoEBlock`` alone gives ``DeepseekV3MoE.forward``'s output bit for bit."""
    g = torch.Generator().manual_seed(tokens)
    for block in glm45_blocks(save_moe('glm4_moe', str(tmp_path))):
        x = torch.randn(tokens, 48, generator=g).bfloat16()
        assert torch.equal(block.native_moe()(x=x), block(x))


def test_glm45_routing_options_change_the_block(tmp_path, native_gemms, monkeypatch):
    """Each part of the grouped routing counts, in the stack's block as in the Python forward: on 40 tokens, no
    correction bias, all groups allowed, a scaling of 1 or no renormalization each change the output (the bias and
    the groups by choosing other experts), and the block follows the forward in each."""
    block = glm45_blocks(save_moe('glm4_moe', str(tmp_path)))[0]
    assert (block.num_groups, block.topk_groups, block.scaling) == (2, 1, 2.5)
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits = block.gate(x)
    expected, (_, ids) = block(x), block.route(logits)
    no_bias = torch.nn.Parameter(torch.zeros_like(block.gate.e_score_correction_bias), requires_grad=False)
    for owner, name, value, reroutes in [(block.gate, 'e_score_correction_bias', no_bias, True),
                                         (block, 'topk_groups', 2, True), (block, 'scaling', 1.0, False),
                                         (block, 'renormalize', False, False)]:
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, value)
            changed = block(x)
            assert torch.equal(block.native_moe()(x=x), changed), name
            assert not torch.equal(changed, expected), name
            other_ids = block.route(logits)[1]
            assert (not torch.equal(other_ids.sort(-1)[0], ids.sort(-1)[0])) == reroutes, name


def test_ernie45_stack_equals_the_layers(tmp_path, native_gemms, monkeypatch):
    """ERNIE 4.5 MoE: its dense first layer and interleaved rotary, every layer in the stack, the MoE layers as
    ``MoEBlock``s routed ``biased_softmax`` (fp32 router, ungated shared expert), equal to the layers' forward at
    every step."""
    assert_two_moe_layers_in_the_stack(save_moe('ernie4_5_moe', str(tmp_path)), monkeypatch)


@pytest.mark.parametrize('tokens', [1, 5, 40])
def test_ernie45_block_equals_the_python_forward(tokens, tmp_path, native_gemms):
    """ERNIE 4.5 MoE's ``MoEBlock`` alone gives ``Ernie4_5MoE.forward``'s output bit for bit."""
    g = torch.Generator().manual_seed(tokens)
    blocks = moe_blocks(Engine(save_moe('ernie4_5_moe', str(tmp_path)), PytorchEngineConfig(**ENGINE),
                               show_progress=False))
    for block in blocks:
        x = torch.randn(tokens, 64, generator=g).bfloat16()
        assert torch.equal(block.native_moe()(x=x), block(x))


def test_ernie45_routing_options_change_the_block(tmp_path, native_gemms, monkeypatch):
    """Each part of the biased softmax routing counts, in the stack's block as in the Python forward: on 40 tokens,
    no correction bias (other experts chosen) or a norm_min above the chosen scores' sum change the output, and the
    block follows the forward in each; the block routed plain ``softmax`` instead differs from the forward."""
    block = moe_blocks(Engine(save_moe('ernie4_5_moe', str(tmp_path)), PytorchEngineConfig(**ENGINE),
                              show_progress=False))[0]
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    expected = block(x)
    statics = block.moe_statics
    no_bias = torch.nn.Parameter(torch.zeros_like(statics.e_score_correction_bias), requires_grad=False)
    for owner, name, value in [(statics, 'e_score_correction_bias', no_bias), (block, 'norm_min', 2.0)]:
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, value)
            changed = block(x)
            assert torch.equal(block.native_moe()(x=x), changed), name
            difference = (changed.float() - expected.float()).abs().max().item()
            print(f'ERNIE 4.5 MoE block with {name}={value if name == "norm_min" else 0}: differs by {difference:.3g}')
            assert difference > 0.01, name
    softmax = native_gemms.MoEBlock(router=block.gate.native_projection(),
                                    top_k=block.top_k, renormalize=True, routing='softmax',
                                    **block.experts.kernel.native_experts())
    plain = softmax(x=x) + block.shared_experts(x)
    difference = (plain.float() - expected.float()).abs().max().item()
    print(f"ERNIE 4.5 MoE block routed 'softmax': differs by {difference:.3g}")
    assert difference > 0.01


@pytest.mark.parametrize('kind', ['qwen2_moe', 'glm4_moe', 'ernie4_5_moe'])
def test_shared_expert_small_steps_on_int4_copies(kind, tmp_path, native_gemms, monkeypatch):
    """With ``decode_int4`` the shared expert (Qwen2-MoE's gated one, GLM-4.5's and ERNIE 4.5's ungated ones) keeps
    4-bit copies for steps of up to two tokens: those steps run in the stack's small-step layers, on the copies, equal
    to the layers' forward."""
    if cpu.int4_gemv() is None:
        pytest.skip('the native int4 GEMV needs AVX512-BF16')
    engine = Engine(save_moe(kind, str(tmp_path)), PytorchEngineConfig(decode_int4=True, **ENGINE),
                    show_progress=False)
    stack = engine.runner.model.native_stack
    assert stack.small is not None and stack.small_step_rows == 2
    steps = run_checked(engine, monkeypatch, batched_equals_solo=False)
    assert (0, 1) in steps and (0, 4) in steps


@pytest.fixture(scope='module')
def gguf_moe(tmp_path_factory):
    """A MoE GGUF file of a family and experts' types, converted for serving once."""
    paths = {}

    def get(kind: str, types: dict[str, Q]) -> Path:
        key = (kind, tuple(sorted((name, int(t)) for name, t in types.items())))
        if key not in paths:
            tmp = tmp_path_factory.mktemp(f'gguf_{kind}')
            if kind == 'glm4_moe':
                write_k_quant_glm4_moe(tmp / 'hf', tmp / 'model.gguf', types)
            else:
                write_mixed_gguf(kind, tmp / 'hf', tmp / 'model.gguf', types)
            convert_gguf(str(tmp / 'model.gguf'), str(tmp / 'served'))
            paths[key] = tmp / 'served'
        return paths[key]

    return get


def record_q6k_expert_paths(engine: Engine, monkeypatch) -> list[str]:
    """The path of each call of a Q6_K expert's projection in the layers' forward (``gemv`` or ``dequantized``),
    recorded as they run."""
    kernels = [module.kernel.kernel(proj, e) for module in engine.runner.model.modules()
               if isinstance(module, FusedExperts) for proj in ('gate_up', 'down') for e in range(module.num_experts)]
    q6k = [kernel for kernel in kernels
           if isinstance(kernel, SmallStepInt4Kernel) and isinstance(kernel.small, Q6KGemv)]
    paths = {id(part): name for kernel in q6k for name, part in (('gemv', kernel.small), ('dequantized', kernel.large))}
    recorded = []
    for cls in (Q6KGemv, KQuantDequantized):
        def call(self, x: torch.Tensor, bias: torch.Tensor | None, _call=cls.__call__) -> torch.Tensor:
            if id(self) in paths:
                recorded.append(paths[id(self)])
            return _call(self, x, bias)

        monkeypatch.setattr(cls, '__call__', call)
    return recorded


@pytest.mark.parametrize('kind', sorted(NATIVE_FILES))
def test_gguf_experts_stack_equals_the_layers(kind, gguf_moe, native_gemms, monkeypatch):
    """bf16 on a GGUF file: Q4_K experts' decode rows on the Q4_K GEMV and their prefill rows dequantized per call,
    Q6_K experts on the Q6_K GEMV and Mixtral's Q5_K down on the Q5_K GEMV likewise, in both stacks; equal to the
    layers' forward (Qwen2-MoE's and GLM-4.5's Q6_K shared down likewise)."""
    if cpu.int4_gemv() is None or cpu.q6k_gemv() is None:
        pytest.skip('the native GEMVs need AVX512-BF16')
    engine = Engine(str(gguf_moe(kind, NATIVE_FILES[kind])),
                    PytorchEngineConfig(max_prefill_token_num=96, **ENGINE), show_progress=False)
    stack = engine.runner.model.native_stack
    assert stack is not None and stack.small is not None  # the K-quant attention's decode rows on its GEMVs
    q6k_paths = record_q6k_expert_paths(engine, monkeypatch)
    steps = run_checked(engine, monkeypatch, batched_equals_solo=False)
    assert any(rows > 64 for _, rows in steps)  # some expert's share above 32 rows
    assert (0, 1) in steps and (0, 4) in steps
    if Q.Q6_K in (t for name, t in NATIVE_FILES[kind].items() if name.endswith('ffn_down_exps')):
        assert set(q6k_paths) == {'gemv', 'dequantized'}  # decode rows, prefill rows, as the stack's


def test_q8_0_experts_stack_equals_the_layers(gguf_moe, native_gemms, monkeypatch):
    """A Q8_0 ``ffn_down_exps`` (test_gguf_moe.py's Q4_K_M-like Qwen3-MoE file): its experts' decode rows on the
    8-bit GEMV and their prefill rows dequantized per call, in the stacks as in the layers."""
    if cpu.int4_gemv() is None or cpu.q6k_gemv() is None or cpu.q8_gemv() is None:
        pytest.skip('the native GEMVs need AVX512-BF16')
    engine = Engine(str(gguf_moe('qwen3_moe', FILES['qwen3_moe'][0])),
                    PytorchEngineConfig(max_prefill_token_num=96, **ENGINE), show_progress=False)
    down = moe_blocks(engine)[1].experts.kernel.kernel('down', 0)
    assert isinstance(down.small, Q8_0Gemv) and isinstance(down.large, KQuantDequantized)
    assert engine.runner.model.native_stack is not None
    steps = check_every_step(engine, monkeypatch)
    run(engine, random_prompts([20, 70, 9, 33], seed=8, vocab=250), GenerationConfig(max_new_tokens=3, ignore_eos=True))
    assert any(rows > 64 for _, rows in steps) and (0, 4) in steps


@pytest.mark.parametrize('tokens', [1, 5, 40])
def test_block_equals_the_python_forward(tokens, tmp_path, native_gemms):
    """The ``MoEBlock`` alone gives ``SparseMoeBlock.forward``'s output bit for bit (Qwen2-MoE: routed and
    shared experts), at decode and prefill sizes."""
    engine = Engine(save_tiny_model('qwen2_moe', str(tmp_path)), PytorchEngineConfig(**ENGINE), show_progress=False)
    g = torch.Generator().manual_seed(tokens)
    for block in moe_blocks(engine):
        x = torch.randn(tokens, 64, generator=g).bfloat16()
        assert torch.equal(block.native_moe()(x=x), block(x))


@pytest.mark.parametrize('kind', ['qwen3_moe', 'glm4_moe', 'ernie4_5_moe'])
def test_fp32_keeps_the_layers(kind, tmp_path):
    """In fp32 the projections run on no native GEMM, so MoE models keep their layers as dense ones do."""
    engine = Engine(save_moe(kind, str(tmp_path)), PytorchEngineConfig(**{**ENGINE, 'dtype': 'float32'}),
                    show_progress=False)
    assert engine.runner.model.native_stack is None
    assert all(block.native_moe() is None for block in moe_blocks(engine))


@pytest.mark.parametrize('kind', ['qwen2_moe', 'glm4_moe', 'ernie4_5_moe'])
def test_without_native_kernels_keeps_the_layers(kind, tmp_path, monkeypatch):
    """Without the native kernels (no compiler, ``LMDEPLOY_CPU_KERNELS=0``) a bf16 MoE model runs its layers."""
    monkeypatch.setattr(cpu, 'native', lambda: None)
    engine = Engine(save_moe(kind, str(tmp_path)), PytorchEngineConfig(**ENGINE), show_progress=False)
    assert engine.runner.model.native_stack is None
    assert all(block.native_moe() is None for block in moe_blocks(engine))
    outs = run(engine, random_prompts([9], seed=3), GenerationConfig(max_new_tokens=3, ignore_eos=True))
    assert [len(out) for out in outs] == [3]


def test_bad_blocks_are_refused(native_gemms):
    """A MoE block's experts are dense or per expert, never both nor neither; top_k fits the experts; a shared
    expert has all its parts; a layer has a MoE block or gate_up and down."""
    weight = torch.zeros(32, 16, dtype=torch.bfloat16)
    proj = native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_weight(weight))
    dense = dict(gate_up=torch.zeros(4, 32, 16, dtype=torch.bfloat16), down=torch.zeros(4, 16, 16, dtype=torch.bfloat16))
    native_gemms.MoEBlock(router=proj, top_k=2, renormalize=True, routing='softmax', **dense)
    for options, match in [({}, 'dense gate_up and down, or each'),
                           (dict(**dense, expert_gate_up=[proj], expert_down=[proj]), 'dense gate_up and down, or each'),
                           (dict(expert_gate_up=[proj, proj], expert_down=[proj]), 'as many of each'),
                           (dict(gate_up=dense['gate_up'], down=torch.zeros(3, 16, 16)), r'\[E, 2I, H\]'),
                           (dict(**dense, top_k=5), '1 to num_experts'),
                           (dict(**dense, shared_gate_up=proj), 'gate_up and down projections'),
                           (dict(**dense, shared_gate=proj), 'gate_up and down projections')]:
        with pytest.raises(RuntimeError, match=match):
            native_gemms.MoEBlock(**{'router': proj, 'top_k': 2, 'renormalize': False, 'routing': 'softmax',
                                     **options})
    with pytest.raises(TypeError):  # the routing is named, never left out
        native_gemms.MoEBlock(router=proj, top_k=2, renormalize=True, **dense)
    with pytest.raises(RuntimeError, match="'sigmoid_scaled_input', 'noaux_tc', 'greedy' or 'group_limited_greedy', "
                                           "not 'sigmoid'"):
        native_gemms.MoEBlock(router=proj, top_k=2, renormalize=True, routing='sigmoid', **dense)
    grouped = dict(correction_bias=torch.zeros(4), num_groups=2, topk_groups=1, scaling=2.5)
    native_gemms.MoEBlock(router=proj, top_k=2, renormalize=True, routing='noaux_tc', **grouped, **dense)
    biased = dict(correction_bias=torch.zeros(4), norm_min=1e-12)
    native_gemms.MoEBlock(router=proj, top_k=2, renormalize=True, routing='biased_softmax', **biased, **dense)
    for options, match in [(dict(routing='softmax', **grouped), 'belong to other routings'),
                           (dict(routing='softmax', scaling=2.0), 'belong to other routings'),
                           (dict(routing='softmax', norm_min=1e-12), 'belong to other routings'),
                           (dict(routing='noaux_tc', correction_bias=torch.zeros(4)), 'takes correction_bias'),
                           (dict(routing='noaux_tc', **grouped, norm_min=1e-12), 'not norm_min'),
                           (dict(routing='biased_softmax', correction_bias=torch.zeros(4)),
                            'takes correction_bias and'),
                           (dict(routing='biased_softmax', **biased, scaling=2.0), 'takes correction_bias and'),
                           (dict(routing='biased_softmax', **biased, renormalize=False), 'and renormalizes'),
                           (dict(routing='biased_softmax', **{**biased, 'correction_bias': torch.zeros(3)}),
                            'per expert'),
                           (dict(routing='sigmoid_scaled_input'), 'does not renormalize'),
                           (dict(routing='sigmoid_scaled_input', renormalize=False, scaling=2.0),
                            'belong to other routings'),
                           (dict(routing='noaux_tc', **{**grouped, 'correction_bias': torch.zeros(3)}), 'per expert'),
                           (dict(routing='noaux_tc', **{**grouped, 'num_groups': 3}), 'equal groups of two'),
                           (dict(routing='noaux_tc', **{**grouped, 'num_groups': 4}), 'equal groups of two'),
                           (dict(routing='noaux_tc', **{**grouped, 'topk_groups': 3}), 'topk_groups is 1 to'),
                           (dict(routing='noaux_tc', **{**grouped, 'topk_groups': 0}), 'topk_groups is 1 to'),
                           (dict(routing='noaux_tc', **grouped, top_k=3), 'their experts hold top_k')]:
        with pytest.raises(RuntimeError, match=match):
            native_gemms.MoEBlock(**{'router': proj, 'top_k': 2, 'renormalize': True, **options, **dense})
    for fp32_weight in (weight, weight.float()):  # the packed tiles, never a weight to pack again
        with pytest.raises(RuntimeError, match="weight's packed tiles"):
            native_gemms.Projection(kind='fp32', weight=fp32_weight, outputs=32)
    with pytest.raises(RuntimeError, match="outputs fill its last panel's rows"):
        native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_weight(weight), outputs=33)
    # 16 of 32 rows: a gate and an up of 8 rows each, each padded to a panel; no plain projection's outputs
    half_panels = native_gemms.Projection(kind='bf16', weight=native_gemms.pack_bf16_gate_up(weight), outputs=16)
    assert half_panels.gate_up_silu(x=torch.ones(3, 16, dtype=torch.bfloat16)).shape == (3, 8)
    with pytest.raises(RuntimeError, match='panels hold 17 to 32 outputs, not 16'):
        half_panels(x=torch.ones(3, 16, dtype=torch.bfloat16))
    moe = native_gemms.MoEBlock(router=proj, top_k=2, renormalize=True, routing='softmax', **dense)
    norm = torch.ones(16, dtype=torch.bfloat16)
    stack = dict(num_heads=1, num_kv_heads=1, head_dim=16, eps=1e-6, scale=0.25, quant_policy=0)
    layer = dict(input_norm=norm, post_norm=norm, qkv=proj, o=proj, rotary_dim=16)
    native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, moe=moe)], **stack)
    for mlp in [{}, dict(moe=moe, gate_up=proj, down=proj), dict(gate_up=proj)]:
        with pytest.raises(RuntimeError, match='gate_up and down projections or its moe block'):
            native_gemms.DecoderStack(layers=[native_gemms.LayerWeights(**layer, **mlp)], **stack)
