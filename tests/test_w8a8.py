"""W8A8: SmoothQuant smoothing is a no-op before quantization, the int8 GEMMs (native VNNI, Triton) equal
the torch reference, and ``lmdeploy lite smooth_quant`` checkpoints load without a flag and generate
mostly the tokens of the model they came from."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny_model
from helpers import make_engine, random_prompts, run
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmdeploy import PytorchEngineConfig
from lmdeploy.cli.main import main
from lmdeploy.lite.smooth_quant import collect_act_scales, smooth
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu, silu_and_mul
from lmdeploy.pytorch.kernels.w8a8 import quantize_weight, w8a8_linear
from lmdeploy.pytorch.nn.quant import w8a8 as w8a8_format

PROMPTS = random_prompts([7, 19, 33, 12], seed=5)


@pytest.mark.parametrize('kind', ['llama', 'qwen2', 'qwen3'])
def test_smoothing_is_a_noop_in_fp32(kind, tmp_path):
    """GQA (v_proj -> o_proj shares factors over query heads), q/k/v biases (Qwen2), q/k norms (Qwen3)."""
    path = save_tiny_model(kind, str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(random_prompts([96], seed=1)[0])
    scales = collect_act_scales(model, ids, seq_len=32)
    state = load_file(f'{path}/model.safetensors')
    smooth(state, scales, json.loads(open(f'{path}/config.json').read()), alpha=0.5)
    smoothed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    smoothed.load_state_dict(state, strict=False)
    norm = 'model.layers.0.input_layernorm.weight'
    assert not torch.equal(smoothed.state_dict()[norm], model.state_dict()[norm])
    with torch.no_grad():
        expected, got = model(ids[None]).logits, smoothed(ids[None]).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4


def _case(M: int, K: int, N: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * torch.rand(K, generator=g) * 4).to(dtype)
    weight, scale = quantize_weight(torch.randn(N, K, generator=g) * 0.05)
    return x, weight, scale, (torch.randn(N, generator=g).to(dtype) if bias else None)


@pytest.mark.skipif(cpu.int8_gemm() is None, reason='the native int8 GEMM needs AVX512-VNNI')
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 6, 7, 13, 64, 67, 130])
def test_native_int8_gemm_matches_reference(dtype, M):
    """Tiles of 6 rows (a lone row block) or 4 and their remainders, row blocks of 64, column groups of 4
    panels and a remainder, K not a multiple of 16 (masked tails), an all-zero row."""
    for K, N, bias in [(576, 80, True), (20, 48, False), (1536, 64, False)]:
        x, weight, scale, b = _case(M, K, N, dtype, bias)
        x[0] = 0
        kernel = w8a8_format.NativeW8A8Kernel(weight, scale)
        got, expected = kernel(x, b), w8a8_linear(x, weight, scale, b)
        assert got.dtype == dtype and got.shape == expected.shape
        # the same int32 sums; the epilogue may round differently by one step of the output dtype
        tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
        assert torch.equal(got[0], expected[0])


@pytest.mark.skipif(cpu.int8_gemm() is None, reason='the native int8 GEMM needs AVX512-VNNI')
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('M', [1, 5, 6, 64, 67])
def test_native_int8_gate_up_silu_is_silu_and_mul_of_the_gemm(dtype, M):
    """SiLU-and-mul in the epilogue of the GEMM over panels alternating gate and up (5 pairs: groups of 4
    panels and a remainder): silu_and_mul of the plain GEMM's output, within one step of the dtype."""
    x, weight, scale, b = _case(M, 576, 160, dtype, True)
    fused = w8a8_format.NativeW8A8Kernel(weight, scale, gate_up=True)
    got, expected = fused.gate_up_silu(x, b), silu_and_mul(w8a8_format.NativeW8A8Kernel(weight, scale)(x, b))
    assert got.dtype == dtype and got.shape == (M, 80)
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match='only as gate_up_silu'):
        fused(x, b)


def test_reference_is_close_to_fp32_matmul():
    x, weight, scale, b = _case(9, 256, 64, torch.float32, True)
    exact = x @ (weight.float() * scale).T + b
    got = w8a8_linear(x, weight, scale, b)
    assert ((got - exact).norm() / exact.norm()).item() < 0.01


@pytest.mark.triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_triton_int8_gemm_matches_reference(dtype):
    pytest.importorskip('triton')
    from lmdeploy.pytorch.kernels.cuda.w8a8 import w8a8_linear as triton_w8a8_linear
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    for M, K, N, bias in [(3, 72, 40, True), (17, 128, 96, False)]:
        x, weight, scale, b = _case(M, K, N, dtype, bias)
        x[1] = 0
        got = triton_w8a8_linear(x.to(device), weight.to(device), scale.to(device), None if b is None else b.to(device))
        torch.testing.assert_close(got.cpu().float(), w8a8_linear(x, weight, scale, b).float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('native', [True, False])
def test_int8_lm_head_gives_fp32_logits_of_the_reference(dtype, native, monkeypatch):
    """A W8A8 model's LM head: the table quantized per vocabulary row (a slice at a time), the hidden states
    per token, fp32 logits; the native GEMM over 3,000 panels and the torch version as on a CPU without VNNI."""
    if native and cpu.int8_gemm() is None:
        pytest.skip('the native int8 GEMM needs AVX512-VNNI')
    if not native:
        monkeypatch.setattr(cpu, 'int8_gemm', lambda: None)
    g = torch.Generator().manual_seed(3)
    table = (torch.randn(49152, 64, generator=g) * 0.05).to(dtype)
    kernel = w8a8_format.W8A8Format().lm_head_kernel(table)
    assert isinstance(kernel.kernel, w8a8_format.NativeW8A8Kernel if native else w8a8_format.W8A8Kernel)
    weight, scale = quantize_weight(table)
    assert torch.equal(w8a8_format.Int8Rows.of(table, rows_at_once=1000).weight, weight)
    for rows in (1, 7, 64):
        hidden = (torch.randn(rows, 64, generator=g) * torch.rand(64, generator=g) * 4).to(dtype)
        got = kernel(hidden, None)
        expected = w8a8_linear(hidden.float(), weight, scale)
        assert got.dtype == torch.float32 and got.shape == (rows, 49152)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        exact = hidden.float() @ table.float().T
        assert ((got - exact).norm() / exact.norm()).item() < 0.02


@pytest.fixture(scope='module')
def tiny_w8a8(tmp_path_factory) -> tuple[str, str]:
    """A tiny random Llama (GQA) and its ``lmdeploy lite smooth_quant`` copy, made through the CLI."""
    source = save_tiny_model('llama', str(tmp_path_factory.mktemp('llama')))
    out = str(tmp_path_factory.mktemp('llama_w8a8'))
    main(['lite', 'smooth_quant', source, out, '--calib-tokens', '1024', '--calib-seqlen', '256'])
    return source, out


def _agreement(expected: list[list[int]], got: list[list[int]]) -> float:
    """The fraction of tokens generated before a prompt's first difference."""
    same = 0
    for e, g in zip(expected, got):
        same += next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), len(e))
    return same / sum(len(e) for e in expected)


@pytest.mark.parametrize('flags, message', [
    (['--alpha', '2'], 'alpha must be in [0, 1], got 2.0'),
    (['--calib-tokens', '0'], 'calib_tokens must be at least 1, got 0'),
    (['--calib-seqlen', '0'], 'seq_len must be at least 1, got 0'),
    ([], 'exists and is not a folder'),
])
def test_cli_refuses_bad_arguments_in_one_line_before_any_work(flags, message, tmp_path, capsys):
    out = tmp_path / 'out'
    if not flags:
        out.write_text('a file')
    with pytest.raises(SystemExit) as exited:
        main(['lite', 'smooth_quant', str(tmp_path / 'no-model-read'), str(out), *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('lmdeploy: error: ') and message in err and '\n' not in err


def test_cli_writes_an_int8_checkpoint(tiny_w8a8):
    _, out = tiny_w8a8
    config = json.loads(open(f'{out}/config.json').read())
    assert config['quantization_config']['quant_method'] == 'smooth_quant'
    state = load_file(f'{out}/model.safetensors')
    weight, scale = state['model.layers.0.self_attn.k_proj.weight'], state['model.layers.0.self_attn.k_proj.scale']
    assert weight.dtype == torch.int8 and weight.abs().max() == 127
    assert scale.dtype == torch.float32 and scale.shape == (weight.shape[0], 1)
    assert state['model.embed_tokens.weight'].is_floating_point()


def test_w8a8_checkpoint_loads_without_a_flag_and_generates_mostly_the_same_tokens(tiny_w8a8, monkeypatch):
    source, out = tiny_w8a8
    engine = make_engine(source)
    try:
        expected, expected_logits = run(engine, PROMPTS), engine.get_logits(PROMPTS[2])
    finally:
        engine.close()
    engine = make_engine(out)
    try:
        logits = engine.get_logits(PROMPTS[2])
        proj = engine.runner.model.layers[0].mlp.down_proj
        assert isinstance(proj.weight_format, w8a8_format.W8A8Format)
        on_cpu = engine.config.device == 'cpu'  # gpu_check.sh runs this test on CUDA (the Triton int8 GEMM)
        native = on_cpu and cpu.int8_gemm() is not None
        assert isinstance(proj.kernel, w8a8_format.NativeW8A8Kernel if native else w8a8_format.W8A8Kernel)
        head, embedding = engine.runner.model.lm_head, engine.runner.model.embed_tokens
        if on_cpu:
            assert isinstance(head.packed, w8a8_format.FloatLogitsKernel)  # int8 rows of its table
        assert embedding.weight.dtype == torch.float32
        got = run(engine, PROMPTS)
    finally:
        engine.close()
    # measured: logits 2.0% apart, 52% of the tokens before the first difference (1.7% and 80% with the LM head
    # in fp32: a tiny random model's greedy tokens part at its many near ties; the default model's perplexity
    # is the measure of the int8 LM head, see docs/quantization.md)
    assert ((logits - expected_logits).norm() / expected_logits.norm()).item() < 0.03
    assert _agreement(expected, got) >= 0.5
    if not on_cpu:
        return
    monkeypatch.setattr(cpu, 'int8_gemm', lambda: None)  # as on a CPU without AVX512-VNNI
    engine = make_engine(out)
    try:
        assert isinstance(engine.runner.model.layers[0].mlp.down_proj.kernel, w8a8_format.W8A8Kernel)
        assert isinstance(engine.runner.model.lm_head.packed.kernel, w8a8_format.W8A8Kernel)
        assert run(engine, PROMPTS) == got
    finally:
        engine.close()


def test_w8a8_tp2_matches_tp1(tiny_w8a8):
    """Each rank holds its rows of the int8 weights and of their scales (q/k/v, gate/up), or its columns
    of the weights and all of the scales (o_proj, down_proj). A row-parallel layer quantizes each rank's
    share of a token on its own scale, so the logits differ by the quantization of activations only."""
    _, out = tiny_w8a8
    engine = make_engine(out)
    try:
        expected_tokens, expected_logits = run(engine, PROMPTS), engine.get_logits(PROMPTS[2])
    finally:
        engine.close()
    engine = make_engine(out, tp=2)
    try:
        tokens, logits = run(engine, PROMPTS), engine.get_logits(PROMPTS[2])
    finally:
        engine.close()
    # measured: 1.2% apart, 55% of the tokens before the first difference (a tiny random model's greedy
    # tokens part at the first near tie; rows sharded wrongly give logits about 100% apart)
    assert ((logits - expected_logits).norm() / expected_logits.norm()).item() < 0.03
    assert _agreement(expected_tokens, tokens) >= 0.5


@pytest.mark.slow
def test_default_model_smooth_quant_end_to_end(default_model_gguf, tmp_path):
    """The CLI on the default GGUF model; the W8A8 engine (bf16 activations) against the bf16 engine."""
    out = str(tmp_path / 'w8a8')
    main(['lite', 'smooth_quant', default_model_gguf, out, '--calib-tokens', '1024'])
    prompts = random_prompts([16, 40], seed=2, vocab=20000)
    tokens = {}
    for name, path in (('bf16', default_model_gguf), ('w8a8', out)):
        engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', decode_int4=False, num_gpu_blocks=64,
                                                  block_size=16), show_progress=False)
        try:
            tokens[name] = run(engine, prompts)
        finally:
            engine.close()
    assert _agreement(tokens['bf16'], tokens['w8a8']) >= 0.25
