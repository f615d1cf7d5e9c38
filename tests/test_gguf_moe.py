"""MoE GGUF files (Qwen3-MoE's ``qwen3moe``, Mixtral's ``llama`` with experts) whose experts stay as llama.cpp's
blocks, Q4_K_M-like: Q4_K experts with a Q6_K, Q8_0 or Q5_K ``ffn_down_exps`` in some layers, and gate and up of
different types (not kept) dequantized per projection. In fp32 the greedy tokens equal
transformers' on the weights the ``gguf`` package dequantizes from the file; in bf16 on the CPU each expert runs
on its type's native kernel."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize
from family_checks import assert_tp2_equals_tp1
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from safetensors import safe_open
from test_gguf_linear import dequantized_weight, fp32_kernel
from test_gguf_mixed import ARCHS, bf16_logit_error, served_mixed_gguf
from transformers import AutoModelForCausalLM

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu, moe
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import LinearOptions, use_weight_format
from lmdeploy.pytorch.nn.quant.dense import DenseFormat, DenseKernel
from lmdeploy.pytorch.nn.quant.gguf import GgufExpertsFormat, GgufFormat
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv, Q8Kernel, dequantize_blocks
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel, TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv
from lmdeploy.pytorch.nn.quant.q5k_cpu import Q5KGemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import KQuantDequantized, Q6KGemv, gemv_max_rows
from lmdeploy.pytorch.nn.quant.w4a16 import ReferenceKernel

# Qwen3-MoE as Q4_K_M: Q6_K in layer 0's attn_v (its q/k/v dequantized) and ffn_down_exps, a Q8_0 ffn_down_exps
# in layer 1 and a Q6_K output. Qwen2-MoE (a shared expert, kept as blocks too): a Q6_K ffn_down_exps in layer 1
# and a Q6_K shared down in layer 2. Mixtral: layer 0's ffn_down_exps Q5_K (kept too),
# layer 1's ffn_up_exps Q8_0 beside a Q4_K gate (gate and up dequantized, its down kept).
FILES = {
    'qwen3_moe': ({'output': Q.Q6_K, 'blk.0.attn_v': Q.Q6_K, 'blk.0.ffn_down_exps': Q.Q6_K,
                   'blk.1.ffn_down_exps': Q.Q8_0, 'default': Q.Q4_K},
                  {0: {'gate_up': 'Q4_K', 'down': 'Q6_K'}, 1: {'gate_up': 'Q4_K', 'down': 'Q8_0'}}),
    'qwen2_moe': ({'blk.1.ffn_down_exps': Q.Q6_K, 'blk.2.ffn_down_shexp': Q.Q6_K, 'default': Q.Q4_K},
                  {0: {'gate_up': 'Q4_K', 'down': 'Q4_K'}, 1: {'gate_up': 'Q4_K', 'down': 'Q6_K'},
                   2: {'gate_up': 'Q4_K', 'down': 'Q4_K'}}),
    'mixtral': ({'blk.0.ffn_down_exps': Q.Q5_K, 'blk.1.ffn_up_exps': Q.Q8_0, 'default': Q.Q4_K},
                {0: {'gate_up': 'Q4_K', 'down': 'Q5_K'}, 1: {'gate_up': 'dense', 'down': 'Q4_K'}}),
}


@pytest.fixture(scope='module', params=sorted(FILES))
def moe_file(request, tmp_path_factory) -> tuple[str, Path]:
    kind = request.param
    tmp = tmp_path_factory.mktemp(f'moe_{kind}')
    served_mixed_gguf(kind, tmp, FILES[kind][0])
    return kind, tmp


def llama_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of llama.cpp's converter's q/k row permutation."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_reference(kind: str, tmp: Path) -> torch.nn.Module:
    """transformers' model of the tiny checkpoint with every weight replaced by the ``gguf`` package's
    dequantization of the file's tensor: the experts' gate and up stacked back, llama's q/k rows un-permuted."""
    import gguf
    model = AutoModelForCausalLM.from_pretrained(str(tmp / 'hf'), dtype=torch.float32).eval()
    config = model.config
    stored = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
              for t in GGUFReader(str(tmp / 'model.gguf')).tensors}
    names = gguf.get_tensor_name_map(ARCHS[kind], config.num_hidden_layers)
    state = {}
    for name, value in model.state_dict().items():
        if name.endswith('experts.gate_up_proj'):
            parts = [stored[names.get_name(name.replace('gate_up_proj', f'{p}_proj.weight'), try_suffixes=('.weight',))]
                     for p in ('gate', 'up')]
            state[name] = torch.cat(parts, dim=1)
            continue
        suffix = '' if name.endswith(('.weight', '.bias')) else '.weight'
        weight = stored[names.get_name(name + suffix, try_suffixes=('.weight', '.bias'))]
        if kind == 'mixtral' and name.endswith(('q_proj.weight', 'k_proj.weight')):
            heads = config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads
            weight = llama_unpermute(weight, heads)
        state[name] = weight.view(value.shape)
    model.load_state_dict(state)
    return model


def expert_formats(engine: Engine) -> dict[int, dict[str, str]]:
    """Each MoE layer's experts' projections: the GGML type of those kept as blocks, else ``dense``."""
    formats = {}
    for name, module in engine.runner.model.named_modules():
        if isinstance(module, FusedExperts):
            assert isinstance(module.weight_format, GgufExpertsFormat), name
            formats[int(name.split('.')[1])] = {
                proj: fmt.ggml_type if isinstance(fmt, GgufFormat) else 'dense'
                for proj, fmt in module.weight_format.formats.items()}
    return formats


def test_experts_are_kept_as_blocks_per_expert(moe_file):
    """The converted folder holds each expert's projections of a kept type as its blocks (``uint8``, no float
    copy), one file per layer, and ``ggml_types`` names them by the engine's ``FusedExperts`` projections."""
    kind, tmp = moe_file
    served = tmp / 'served'
    ggml_types = json.loads((served / 'config.json').read_text())['quantization_config']['ggml_types']
    expected = {f'layers.{i}.mlp.experts.{proj}_proj': kind_ for i, layer in FILES[kind][1].items()
                for proj, kind_ in layer.items() if kind_ != 'dense'}
    assert {name: t for name, t in ggml_types.items() if '.experts.' in name} == expected
    if kind == 'qwen2_moe':
        assert ggml_types['layers.0.mlp.shared_expert.gate_up_proj'] == 'Q4_K'
        assert ggml_types['layers.2.mlp.shared_expert.down_proj'] == 'Q6_K'
    index = json.loads((served / 'model.safetensors.index.json').read_text())['weight_map']
    assert len(set(index.values())) == len(FILES[kind][1]) + 1  # one file per layer, one for the rest
    dtypes = {}
    for shard in set(index.values()):
        with safe_open(str(served / shard), framework='pt') as f:
            dtypes |= {name: f.get_slice(name).get_dtype() for name in f.keys() if '.experts.' in name}
    for layer, projections in FILES[kind][1].items():
        for expert in range(4):
            for part in ('gate', 'up', 'down'):
                kept = projections['down' if part == 'down' else 'gate_up'] != 'dense'
                name = f'model.layers.{layer}.mlp.experts.{expert}.{part}_proj.{"qweight" if kept else "weight"}'
                assert dtypes.pop(name) == ('U8' if kept else 'F32'), name
    assert not dtypes


def test_fp32_tokens_match_transformers_on_the_file_weights(moe_file):
    """Each layer's experts in their types' formats; fp32 greedy tokens equal transformers' on the weights gguf
    dequantizes from the file, batched equal to solo."""
    kind, tmp = moe_file
    prompts = random_prompts([6, 19, 33], seed=4, vocab=250)
    engine = make_engine(str(tmp / 'served'))
    try:
        assert expert_formats(engine) == FILES[kind][1]
        batched = run(engine, prompts)
        solo = [run(engine, [prompt])[0] for prompt in prompts]
    finally:
        engine.close()
    assert batched == solo
    reference = gguf_reference(kind, tmp)
    assert_transformers_greedy(reference, prompts, batched)


def count_calls(monkeypatch: pytest.MonkeyPatch, classes: list[type]) -> dict[str, int]:
    """Counts the calls of each class's ``__call__`` and ``gate_up_silu`` (by class name)."""
    calls = dict.fromkeys((cls.__name__ for cls in classes), 0)
    for cls in classes:
        for method in ('__call__', 'gate_up_silu'):
            original = getattr(cls, method)

            def counted(self, *args, _original=original, _name=cls.__name__, **kwargs):
                calls[_name] += 1
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(cls, method, counted)
    return calls


def gemv_of(kernel: object) -> object:
    """An expert's kernel for its decode rows: a K-quant GEMV's (:class:`SmallStepInt4Kernel`'s ``small``), else
    its one kernel."""
    return kernel.small if isinstance(kernel, SmallStepInt4Kernel) else kernel


def test_bf16_experts_run_on_their_native_kernels(moe_file, monkeypatch):
    """bf16 on the CPU: Q4_K experts' decode rows on the Q4_K GEMV (gate and up with their SiLU epilogue), Q6_K,
    Q5_K and Q8_0 ones on theirs, their prefill rows dequantized per call (the one step run here: those are called;
    the decode rows' GEMVs run in test_decoder_stack_moe.py), dense projections on ``F.linear``; the
    logits stay within 15% of fp32's: each kernel is within 1% of fp32 on its own (the expert tests above), but in
    this tiny random model a bf16 rounding can flip a token's choice of experts, which moves the logits by about
    10%."""
    kind, tmp = moe_file
    if os.environ.get('LMDEPLOY_TEST_DEVICE', 'cpu') != 'cpu':
        pytest.skip('CPU kernels')
    if cpu.int4_gemv() is None or cpu.q6k_gemv() is None or cpu.q8_gemv() is None or cpu.q5k_gemv() is None:
        pytest.skip('the native GEMVs need AVX512-BF16')
    kernels = {'Q4_K': Q4KGemv, 'Q5_K': Q5KGemv, 'Q6_K': Q6KGemv, 'Q8_0': Q8_0Gemv, 'dense': DenseKernel}
    used = {DenseKernel if t == 'dense' else KQuantDequantized for layer in FILES[kind][1].values()
            for t in layer.values()}
    calls = count_calls(monkeypatch, sorted(used, key=lambda cls: cls.__name__))

    def check_kernels(engine: Engine) -> None:
        calls.update(dict.fromkeys(calls, 0))  # the bf16 engine's calls only
        engine.runner.model.native_stack = None  # the stack runs the same kernels natively (test_decoder_stack_moe)
        for name, module in engine.runner.model.named_modules():
            if isinstance(module, FusedExperts):
                assert not list(module.parameters())  # the kernels hold the experts now
                for proj, t in FILES[kind][1][int(name.split('.')[1])].items():
                    assert all(isinstance(gemv_of(module.kernel.kernel(proj, e)), kernels[t]) for e in range(4))

    error = bf16_logit_error(tmp / 'served', check_kernels)
    assert all(calls.values()), calls
    assert error < 0.15, error


def random_gguf_experts(types: dict[str, str], hidden: int = 256, inter: int = 256) -> FusedExperts:
    """Experts of 4 with random blocks of ``types`` per projection (``gate_up``, ``down``)."""
    from test_gguf_q4km import random_blocks
    experts_format = GgufExpertsFormat({proj: GgufFormat(t) for proj, t in types.items()})
    with use_weight_format(experts_format):
        experts = FusedExperts(hidden, inter, 4)
    for seed, (proj, rows, inputs) in enumerate((('gate_up', 2 * inter, hidden), ('down', hidden, inter))):
        for e in range(4):
            if types[proj] == 'Q8_0':  # quantized by gguf-py
                weight = np.random.default_rng(10 * seed + e).standard_normal((rows, inputs), dtype=np.float32)
                blocks = torch.from_numpy(quantize(weight, Q.Q8_0)).view(rows, inputs // 32, 34)
            else:
                blocks, _ = random_blocks(getattr(Q, types[proj]), rows, inputs, seed=10 * seed + e)
            getattr(experts, f'{proj}_qweight')[e].copy_(blocks)
    return experts


def dense_weights(experts: FusedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' gate-and-up and down weights dequantized (fp32, exact)."""
    return tuple(torch.stack([dequantize_blocks(experts.projection(proj, e).qweight, fmt.ggml_type)
                              for e in range(experts.num_experts)])
                 for proj, fmt in experts.weight_format.formats.items())


def test_fp32_experts_dequantize_each_routed_expert():
    """The reference path (before load, each routed expert dequantized on its call) equals the fused MoE on the
    dequantized weights; loaded in fp32 on the CPU each expert's blocks are dequantized once (packed for the
    fixed-order fp32 GEMM where it is built), the same outputs up to fp32 rounding."""
    experts = random_gguf_experts({'gate_up': 'Q4_K', 'down': 'Q6_K'})
    gate_up, down = dense_weights(experts)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 256, generator=g)
    weights, ids = moe.moe_routing(torch.randn(9, 4, generator=g), 2, True)
    expected = moe.fused_moe(hidden, gate_up, down, weights, ids)
    reference = experts(hidden, weights, ids)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    experts.finalize(LinearOptions(dtype=torch.float32))
    for proj, dense in (('gate_up', gate_up), ('down', down)):
        for e in range(4):
            kernel = experts.kernel.kernel(proj, e)
            assert isinstance(kernel, fp32_kernel()) and torch.equal(dequantized_weight(kernel), dense[e]), (proj, e)
    assert experts.gate_up_qweight is None and experts.down_qweight is None
    torch.testing.assert_close(experts(hidden, weights, ids), reference, rtol=1e-5,
                               atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize('types', [{'gate_up': 'Q4_K', 'down': 'Q4_K'}, {'gate_up': 'Q4_K', 'down': 'Q6_K'},
                                   {'gate_up': 'Q4_K', 'down': 'Q5_K'}, {'gate_up': 'Q8_0', 'down': 'Q8_0'}],
                         ids=['q4k', 'q4k-q6k', 'q4k-q5k', 'q8_0'])
def test_bf16_cpu_expert_kernels_match_the_file_weights(types, monkeypatch):
    """bf16 experts on the CPU give the fused MoE on gguf's weights up to bf16 rounding, from 1 token to a step whose
    average expert share (2 of 4 experts a token) passes every GEMV's bound on this CPU: outside an engine step small
    shares on the GEMV, large ones dequantized per call."""
    experts = random_gguf_experts(types)
    gate_up, down = dense_weights(experts)
    experts.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
    fallback = {'Q4_K': TorchInt4Kernel, 'Q5_K': ReferenceKernel, 'Q6_K': Q8Kernel, 'Q8_0': Q8Kernel}
    native = {'Q4_K': (Q4KGemv, cpu.int4_gemv()), 'Q5_K': (Q5KGemv, cpu.q5k_gemv()),
              'Q6_K': (Q6KGemv, cpu.q6k_gemv()), 'Q8_0': (Q8_0Gemv, cpu.q8_gemv())}
    for proj, t in types.items():
        kind, built = native[t]
        expected = kind if built is not None else fallback[t]
        for e in range(4):
            kernel = experts.kernel.kernel(proj, e)
            assert isinstance(gemv_of(kernel), expected), (proj, t)
            assert built is None or isinstance(kernel.large, KQuantDequantized), (proj, t)
    q6k_calls, dequantized = [], []  # each Q6_K expert call's (rows, whether it dequantized)
    if cpu.q6k_gemv() is not None:
        dequantized_linear, call = cpu.native().kquant_dequantized_linear, SmallStepInt4Kernel.__call__
        monkeypatch.setattr(cpu.native(), 'kquant_dequantized_linear',
                            lambda *args: dequantized.append(1) or dequantized_linear(*args))

        def recorded(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            before = len(dequantized)
            out = call(self, x, bias)
            if isinstance(self.small, Q6KGemv):
                q6k_calls.append((x.shape[0], len(dequantized) > before))
            return out

        monkeypatch.setattr(SmallStepInt4Kernel, '__call__', recorded)
    g = torch.Generator().manual_seed(3)
    past_bounds = 2 * max(gemv_max_rows(kind) for kind in ('q4k', 'q5k', 'q6k', 'q8_0')) + 64
    for tokens in (1, 3, 40, past_bounds):
        hidden = torch.randn(tokens, 256, generator=g)
        weights, ids = moe.moe_routing(torch.randn(tokens, 4, generator=g), 2, True)
        expected = moe.fused_moe(hidden, gate_up, down, weights, ids)
        out = experts(hidden.bfloat16(), weights, ids).float()
        assert (out - expected).norm() / expected.norm() < 1e-2, tokens
    if 'Q6_K' in types.values() and cpu.q6k_gemv() is not None:
        assert all(large == (rows > gemv_max_rows('q6k')) for rows, large in q6k_calls), q6k_calls
        assert {large for _, large in q6k_calls} == {False, True}, q6k_calls


@pytest.mark.triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('num_tokens', [1, 21])
@pytest.mark.parametrize('types', [{'gate_up': 'Q4_K', 'down': 'Q6_K'}, {'gate_up': 'Q8_0', 'down': 'Q8_0'}],
                         ids=['q4k-q6k', 'q8_0'])
def test_triton_fused_moe_on_gguf_experts(dtype, num_tokens, types):
    """The Triton fused MoE on the experts' blocks, each weight tile dequantized in registers: Q4_K gate-and-up
    grids beside a Q6_K down (Q4_K_M's), and Q8_0 both; against the torch fused MoE on gguf's weights."""
    from kernel_env import DEVICE

    from lmdeploy.pytorch.kernels.cuda.gguf_linear import Q6KExperts, Q8Experts
    experts = random_gguf_experts(types)
    gate_up, down = dense_weights(experts)
    kernel = experts.weight_format.triton_kernel(experts)
    kernel.gate_up, kernel.down = (type(w)(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in w))
                                   for w in (kernel.gate_up, kernel.down))
    assert isinstance(kernel.down, Q6KExperts if types['down'] == 'Q6_K' else Q8Experts)
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, 256, generator=g)
    weights, ids = moe.moe_routing(torch.randn(num_tokens, 4, generator=g), 2, True)
    out = kernel(hidden.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE), None, None, None)
    expected = moe.fused_moe(hidden, gate_up, down, weights, ids)
    tolerance = 1e-2 if dtype != torch.float32 else 2e-3 if DEVICE == 'cuda' else 1e-4
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance,
                               atol=tolerance * expected.abs().max().item())


def test_a_share_that_splits_blocks_is_dequantized():
    """Experts whose down projection's inputs (a tensor-parallel share) split Q4_K blocks hold it dense, its
    blocks dequantized as they load; gate and up keep theirs."""
    from lmdeploy.pytorch.nn.quant.gguf import GgufFileFormat
    weight_format = GgufFileFormat({'layers.0.mlp.experts.gate_up_proj': 'Q4_K',
                                    'layers.0.mlp.experts.down_proj': 'Q4_K'})
    with use_weight_format(weight_format):
        experts = FusedExperts(256, 384, 4)
    layer_format = weight_format.layer_format('layers.0.mlp.experts', experts)
    assert isinstance(layer_format.formats['gate_up'], GgufFormat)
    assert isinstance(layer_format.formats['down'], DenseFormat)
    blocks = torch.zeros(256, 3, 144, dtype=torch.uint8)  # the file's 768 inputs, of which a rank takes 384
    (name, weight), = weight_format.convert_checkpoint([('model.layers.0.mlp.experts.3.down_proj.qweight', blocks)])
    assert name == 'model.layers.0.mlp.experts.3.down_proj.weight' and weight.shape == (256, 768)


@pytest.mark.parametrize('rank, share', [(0, (0, 512)), (1, (512, 768))])
def test_tp_shares_are_whole_blocks_of_the_down_type(rank, share):
    """Under tensor parallelism the experts' features are dealt out in whole blocks of the down projection's
    type: Qwen3-30B-A3B's 768 over 2 ranks as 512 and 256, so Q4_K experts keep their blocks on both ranks."""
    from lmdeploy.pytorch.distributed.parallel_state import TPGroup, use_group
    from lmdeploy.pytorch.nn.quant.gguf import GgufFileFormat
    weight_format = GgufFileFormat({'layers.0.mlp.experts.gate_up_proj': 'Q4_K',
                                    'layers.0.mlp.experts.down_proj': 'Q4_K'})
    with use_group(TPGroup(rank, 2)), use_weight_format(weight_format):
        experts = FusedExperts(256, 768, 4)
        experts.set_weight_format(weight_format.layer_format('layers.0.mlp.experts', experts))
    assert all(isinstance(fmt, GgufFormat) for fmt in experts.weight_format.formats.values())
    assert experts.range == share and not weight_format.dequantized
    assert experts.down_qweight.shape == (4, 256, (share[1] - share[0]) // 256, 144)
    assert experts.gate_up_qweight.shape == (4, 2 * (share[1] - share[0]), 1, 144)


def test_tp2_matches_tp1(moe_file):
    """At tp=2 each rank holds its share of every expert: gate and up rows in whole blocks, down's inputs in
    whole blocks (Q8_0's 32 of the 128 a rank takes) or, where they split blocks (Q4_K's and Q6_K's 256),
    dequantized as they load; the tokens are tp=1's."""
    _, tmp = moe_file
    assert_tp2_equals_tp1(str(tmp / 'served'), random_prompts([5, 17], seed=3, vocab=250))


def test_deepseek_q8_0_experts_kept_as_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A ``deepseek2`` file's Q8_0 experts are served as their blocks (its MLA projections, routers, shared
    experts and dense layers stay dequantized), token for token like transformers on the weights they hold."""
    import gguf
    from conftest import save_random_model
    from family_checks import hf_causal_lm
    from test_gguf import _add_tokenizer, finish
    from test_gguf_archs import converter_tensors, hf_config, write_metadata

    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'deepseek.gguf'
    writer = gguf.GGUFWriter(str(src), 'deepseek2')
    vocab = _add_tokenizer(writer)
    hf = hf_causal_lm(save_random_model(hf_config('deepseek_v3', vocab), str(tmp_path / 'hf'),
                                        std={'e_score_correction_bias': 0.1}))
    with torch.no_grad():  # the experts as the Q8_0 blocks hold them (quantizing them again gives the same blocks)
        for name, param in hf.named_parameters():
            if name.endswith(('experts.gate_up_proj', 'experts.down_proj')):
                param.copy_(torch.from_numpy(dequantize(quantize(param.numpy(), Q.Q8_0), Q.Q8_0)))
    write_metadata(hf.config, writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, hf.config.num_hidden_layers)
    for name, data in converter_tensors(hf, 'deepseek_v3', {}).items():
        expert = '.experts.' in name and data.ndim == 3
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')),
                          quantize(np.ascontiguousarray(data), Q.Q8_0) if expert else np.ascontiguousarray(data),
                          raw_dtype=Q.Q8_0 if expert else None)
    finish(writer)

    engine = make_engine(str(src))
    try:
        sparse = range(hf.config.first_k_dense_replace, hf.config.num_hidden_layers)
        assert expert_formats(engine) == {i: {'gate_up': 'Q8_0', 'down': 'Q8_0'} for i in sparse}
        ggml_types = engine.model_config.hf_config.quantization_config['ggml_types']
        assert all('.mlp.experts.' in name for name in ggml_types)
        prompts = random_prompts([5, 23], vocab=vocab)
        assert_transformers_greedy(hf, prompts, run(engine, prompts))
    finally:
        engine.close()
