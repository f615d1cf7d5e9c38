"""gpt-oss's MXFP4 experts kept as MXFP4 (``nn/quant/mxfp4.py``): the unpacking of OpenAI's checkpoints and of
llama.cpp's MXFP4 type against transformers' and gguf-py's dequantization, the native GEMV and dequantization
(``kernels/cpu/linear_mxfp4.cpp``), their torch fallback and the Triton fused MoE against the dequantized
weights, and tiny random gpt-oss models from an MXFP4 checkpoint and a GGUF file: greedy tokens in fp32 equal
transformers' on the dequantized weights, and the experts hold the MXFP4 bytes."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from transformers import Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from conftest import save_random_model
from family_checks import assert_tp2_equals_tp1, hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf import _add_tokenizer
from test_gguf_archs import hf_config, write_gguf
from test_gguf_mixed import bf16_logit_error
from test_gpt_oss import CONFIG, save_gpt_oss, save_mxfp4

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.kernels import cpu, moe
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import use_weight_format
from lmdeploy.pytorch.nn.quant.mxfp4 import MXFP4_NATIVE_MAX_ROWS, Mxfp4Format, Mxfp4Kernel, dequantize_mxfp4
from lmdeploy.pytorch.weights.gguf_tensors import mxfp4_from_ggml


def random_mxfp4(*rows: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks ``[*rows, in / 32, 16]`` (every code) and scales ``[*rows, in / 32]`` (2^-27 to 2^2)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // 32
    return (torch.randint(0, 256, (*rows, groups, 16), generator=g, dtype=torch.uint8),
            torch.randint(100, 130, (*rows, groups), generator=g, dtype=torch.uint8))


def test_ggml_mxfp4_unpacks_as_gguf_dequantizes():
    """llama.cpp's MXFP4 blocks (gguf-py's quantization of random weights, and random bytes) turned into a
    checkpoint's blocks and scales hold gguf-py's values exactly."""
    g = torch.Generator().manual_seed(0)
    quantized = gguf.quants.quantize(torch.randn(3, 5, 96, generator=g).numpy(), Q.MXFP4)
    raw = torch.randint(0, 256, (4, 7 * 17), generator=g, dtype=torch.uint8)
    raw.view(4, 7, 17)[..., 0] = torch.randint(90, 140, (4, 7), generator=g, dtype=torch.uint8)
    for data in (quantized, raw.numpy()):
        blocks, scales = mxfp4_from_ggml(data)
        expected = torch.from_numpy(gguf.quants.dequantize(data, Q.MXFP4))
        assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), expected)


@pytest.mark.parametrize('native', [True, False], ids=['native', 'torch'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_dequantize_matches_transformers(native, dtype, monkeypatch):
    """The kernels' dequantization (native where built, and torch's) equals transformers' own, exactly."""
    if not native:
        monkeypatch.setattr(cpu, 'mxfp4_gemv', lambda: None)
    elif cpu.mxfp4_gemv() is None:
        pytest.skip('the native MXFP4 kernels are not built here (no AVX-512)')
    blocks, scales = random_mxfp4(2, 24, in_features=96)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    for expert in range(2):
        weight = Mxfp4Kernel(blocks[expert], scales[expert]).dequantize(dtype)
        assert weight.dtype == dtype and torch.equal(weight.float(), expected[expert])


@pytest.mark.parametrize('native', [True, False], ids=['native', 'torch'])
@pytest.mark.parametrize('rows', [1, 3, 4, 9, MXFP4_NATIVE_MAX_ROWS + 1])
@pytest.mark.parametrize('out_features', [24, 7])
def test_fp32_kernel_is_exact_against_dequantized_matmul(native, rows, out_features, monkeypatch):
    """fp32 activations: the GEMV (rows of 4 and the rest, an odd row count of W) and the dequantizing path
    form the products of dequantize-then-matmul; only the order of the fp32 sums differs."""
    if not native:
        monkeypatch.setattr(cpu, 'mxfp4_gemv', lambda: None)
    elif cpu.mxfp4_gemv() is None:
        pytest.skip('the native MXFP4 kernels are not built here (no AVX-512)')
    blocks, scales = random_mxfp4(out_features, in_features=320, seed=rows)
    weight = dequantize_mxfp4(blocks, scales, torch.float64)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2))
    out = Mxfp4Kernel(blocks, scales)(x, bias)
    expected = F.linear(x.double(), weight, bias.double())
    assert out.dtype == torch.float32
    bound = 1e-6 * (x.double().abs() @ weight.abs().T).max().item()  # fp32 rounding of the sums, and no more
    assert (out.double() - expected).abs().max().item() < bound


def test_bf16_gemv_rounds_its_fp32_sums():
    """bf16 activations on the GEMV: the fp32 result of the exact products, rounded once to bf16."""
    if cpu.mxfp4_gemv() is None:
        pytest.skip('the native MXFP4 kernels are not built here (no AVX-512)')
    blocks, scales = random_mxfp4(48, in_features=256, seed=3)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = Mxfp4Kernel(blocks, scales)(x, None)
    native = cpu.mxfp4_gemv().mxfp4_linear(x, blocks, scales)
    expected = F.linear(x.double(), dequantize_mxfp4(blocks, scales, torch.float64))
    assert out.dtype == torch.bfloat16 and torch.equal(out, native.bfloat16())
    assert (native.double() - expected).abs().max().item() < 1e-5 * expected.abs().max().item()


def random_experts(num_experts: int, hidden_size: int, inter: int) -> FusedExperts:
    """gpt-oss-like MXFP4 experts (biased) with random blocks and scales near 2^-3."""
    with use_weight_format(Mxfp4Format()):
        experts = FusedExperts(hidden_size, inter, num_experts, bias=True)
    for proj, inputs in (('gate_up', hidden_size), ('down', inter)):
        blocks, scales = random_mxfp4(num_experts, getattr(experts, f'{proj}_blocks').shape[1], in_features=inputs,
                                      seed=len(proj))
        getattr(experts, f'{proj}_blocks').data, getattr(experts, f'{proj}_scales').data = blocks, scales - 24
    experts.gate_up_bias.data = torch.randn(num_experts, 2 * inter)
    experts.down_bias.data = torch.randn(num_experts, hidden_size)
    return experts


def dequantized(experts: FusedExperts, proj: str) -> torch.Tensor:
    blocks, scales = getattr(experts, f'{proj}_blocks'), getattr(experts, f'{proj}_scales')
    return dequantize_mxfp4(blocks, scales, torch.float32)


@pytest.mark.parametrize('num_tokens', [1, 7, 40])
def test_expert_kernel_matches_fused_moe_on_dequantized_weights(num_tokens):
    """The MXFP4 experts (each routed expert on the GEMV or dequantized, by its share of the step) against the
    torch fused MoE on the dequantized weights, in fp32."""
    experts = random_experts(4, 64, 64)
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, 64, generator=g)
    weights, ids = moe.moe_routing(torch.randn(num_tokens, 4, generator=g), 2, True)
    expected = moe.fused_moe(hidden, dequantized(experts, 'gate_up'), dequantized(experts, 'down'), weights, ids,
                             experts.gate_up_bias, experts.down_bias)
    torch.testing.assert_close(experts(hidden, weights, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('num_tokens', [1, 21])
def test_triton_fused_moe_on_mxfp4_experts(dtype, num_tokens):
    """The Triton fused MoE dequantizing the MXFP4 tiles in registers against the torch fused MoE on the
    dequantized weights (hidden size 96: a K tile that ends inside a block)."""
    from kernel_env import DEVICE

    from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
    from lmdeploy.pytorch.kernels.cuda.fused_moe import Mxfp4Experts, fused_moe
    experts = random_experts(4, 96, 64)
    stacked = [Mxfp4Experts(*(getattr(experts, f'{proj}_{kind}').to(DEVICE) for kind in ('blocks', 'scales')))
               for proj in ('gate_up', 'down')]
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, 96, generator=g)
    weights, ids = moe.moe_routing(torch.randn(num_tokens, 4, generator=g), 2, True)
    activation = ClampedSwiGLU(1.702, 7.0)
    biases = experts.gate_up_bias.data, experts.down_bias.data
    out = fused_moe(hidden.to(DEVICE, dtype), *stacked, weights.to(DEVICE), ids.to(DEVICE),
                    *(b.to(DEVICE, dtype) for b in biases), activation)
    expected = moe.fused_moe(hidden, dequantized(experts, 'gate_up'), dequantized(experts, 'down'), weights, ids,
                             *biases, activation)
    tolerance = 2e-2 if dtype != torch.float32 else 2e-3 if DEVICE == 'cuda' else 1e-4
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


def mxfp4_bytes(num_experts: int, hidden: int, inter: int) -> int:
    """An MXFP4 layer's expert weights: 17 bytes per 32 weights (16 of codes, one scale)."""
    return num_experts * 3 * hidden * inter * 17 // 32


def assert_experts_hold_mxfp4(engine, layers: int) -> None:
    """Every MoE layer's experts hold their blocks and scales (the MXFP4 bytes) and no dense weight."""
    found = 0
    for module in engine.runner.model.modules():
        if isinstance(module, FusedExperts):
            found += 1
            weights = {name: p for name, p in module.named_parameters() if not name.endswith('bias')}
            assert sorted(weights) == ['down_blocks', 'down_scales', 'gate_up_blocks', 'gate_up_scales']
            assert all(p.dtype == torch.uint8 for p in weights.values())
            held = sum(p.numel() * p.element_size() for p in weights.values())
            assert held == mxfp4_bytes(CONFIG['num_local_experts'], CONFIG['hidden_size'],
                                       CONFIG['intermediate_size'])
    assert found == layers


@pytest.fixture(scope='module')
def mxfp4_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp('gpt_oss_mxfp4')
    return save_mxfp4(save_gpt_oss(str(root / 'dense')), str(root / 'mxfp4'))


def test_mxfp4_checkpoint_kept_as_mxfp4_matches_transformers(mxfp4_path):
    """fp32 greedy tokens (one batch: prefills of 2-40 rows an expert, decode steps of 1-3) equal transformers'
    on the dequantized weights; the experts hold the checkpoint's bytes; every block comes back."""
    hf = hf_causal_lm(mxfp4_path, quantization_config=Mxfp4Config(dequantize=True))
    prompts = random_prompts([5, 17, 45], seed=5)
    engine = make_engine(mxfp4_path)
    assert_experts_hold_mxfp4(engine, CONFIG['num_hidden_layers'])
    assert_transformers_greedy(hf, prompts, run(engine, prompts))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences


def test_bf16_engine_runs_the_gemv(mxfp4_path, monkeypatch):
    """A bf16 engine's experts run decode rows on the native GEMV (prefill rows on the dequantized weight); its
    first-step logits stay within 5% of the fp32 engine's (2.3% measured: bf16 activations and attention)."""
    native = cpu.mxfp4_gemv()
    if native is None:
        pytest.skip('the native MXFP4 kernels are not built here (no AVX-512)')
    calls = Counter()

    def counted(name: str):
        def call(*args):
            calls[name] += 1
            return getattr(native, name)(*args)
        return call

    counting = SimpleNamespace(**{name: counted(name) for name in ('mxfp4_linear', 'mxfp4_dequantize',
                                                                    'mxfp4_dequantized_linear')})
    monkeypatch.setattr(cpu, 'mxfp4_gemv', lambda: counting)
    monkeypatch.setattr(cpu, 'bf16_gemm', lambda: None)  # no native stack, whose calls from C++ go uncounted

    def check(engine) -> None:
        calls.clear()  # the bf16 engine's calls only
        assert_experts_hold_mxfp4(engine, CONFIG['num_hidden_layers'])
        run(engine, random_prompts([13], seed=2), GenerationConfig(max_new_tokens=2))  # a decode step

    error = bf16_logit_error(Path(mxfp4_path), check)
    assert calls['mxfp4_linear'] > 0 and calls['mxfp4_dequantized_linear'] > 0 and error < 0.05, (calls, error)


def test_dummy_weights_of_an_mxfp4_checkpoint(mxfp4_path):
    """``load_format='dummy'`` builds the experts as MXFP4 (codes and scales zero) and serves from them."""
    engine = make_engine(mxfp4_path, load_format='dummy')
    assert_experts_hold_mxfp4(engine, CONFIG['num_hidden_layers'])
    experts = next(m for m in engine.runner.model.modules() if isinstance(m, FusedExperts))
    assert not experts.gate_up_blocks.any() and not experts.down_scales.any()
    assert [len(tokens) for tokens in run(engine, random_prompts([5, 9], seed=7))] == [32, 32]


def test_gguf_mxfp4_experts_kept_as_mxfp4_match_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A gpt-oss GGUF file with MXFP4 experts loads as an MXFP4 checkpoint: fp32 greedy tokens equal transformers'
    on the weights the file's blocks hold, and the experts hold its bytes."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'gpt_oss.gguf'
    writer = gguf.GGUFWriter(str(src), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    vocab = _add_tokenizer(writer)
    hf = hf_causal_lm(save_random_model(hf_config('gpt_oss', vocab), str(tmp_path / 'hf'),
                                        std={'gate_up_proj': 4.0}))
    write_gguf(hf, 'gpt_oss', writer, {})  # sets hf's experts to the weights the file's MXFP4 blocks hold
    engine = make_engine(str(src))
    assert engine.model_config.hf_config.quantization_config == {'quant_method': 'mxfp4'}
    assert_experts_hold_mxfp4(engine, CONFIG['num_hidden_layers'])
    prompts = random_prompts([5, 41], vocab=vocab)
    assert_transformers_greedy(hf, prompts, run(engine, prompts))


def test_tp2_equals_tp1(tmp_path):
    """Two ranks, holding 64 and 32 of every expert's 96 features as MXFP4 blocks and scales (shares dealt out
    in whole blocks, as gpt-oss-120b's 90 blocks over 4 ranks), give one rank's tokens."""
    dense = save_gpt_oss(str(tmp_path / 'dense'), intermediate_size=96)
    assert_tp2_equals_tp1(save_mxfp4(dense, str(tmp_path / 'mxfp4')), random_prompts([5, 30], seed=6))


def test_tp2_refuses_a_share_that_splits_blocks(mxfp4_path):
    """32 features, one block, over two ranks would cut it in two: a clear error at load."""
    with pytest.raises(ValueError, match='blocks of 32'):
        make_engine(mxfp4_path, tp=2)


def test_mxfp4_refuses_inputs_that_split_blocks():
    """A projection whose inputs are not whole blocks of 32 gets a clear error."""
    with use_weight_format(Mxfp4Format()), pytest.raises(ValueError, match='blocks of 32'):
        FusedExperts(64, 48, 4, bias=True)
