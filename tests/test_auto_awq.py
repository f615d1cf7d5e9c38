"""``lmdeploy lite auto_awq``: the packing read back by a plain numpy unpacker written from AutoAWQ's
documented order (and by AutoAWQ's own code when installed), checkpoints that transformers' ``AwqConfig``
reads and the engine loads with no flag, generating transformers' tokens on the unpacked weights, the
activation-aware search beating plain round to nearest on a model with outlier channels and choosing the
scales a plain evaluation of every ratio chooses, and the clipping search never raising a layer's output error."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import save_tiny_model
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from quant_models import awq_dequantized
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AwqConfig

from lmdeploy.cli.main import main
from lmdeploy.lite import calibration_text
from lmdeploy.lite import auto_awq as auto_awq_module
from lmdeploy.lite.auto_awq import auto_awq, awq_tensors, clip_weight, fake_quantize, search_scales
from lmdeploy.lite.calibration import (attention_shape, calibration_ids, expand_kv, kv_shared, load_float_model,
                                       load_source)
from lmdeploy.pytorch.nn.quant.awq import AwqFormat

# AutoAWQ's WQLinear_GEMM.from_linear packs the int weight [K, N] eight columns per int32: field i (bits
# 4i to 4i + 3) of int32 c holds column 8c + AUTOAWQ_ORDER[i]; qzeros [K / G, N] the same way.
AUTOAWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
QUANT_LLAMA = dict(hidden_size=256, intermediate_size=512, head_dim=64)
PROJECTIONS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
MLP = ('gate_proj', 'up_proj', 'down_proj')


def numpy_unpack(packed: torch.Tensor) -> np.ndarray:
    """``[rows, N / 8]`` int32 as ``[rows, N]`` codes, in AutoAWQ's order."""
    words = packed.numpy().view(np.uint32)
    fields = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    codes = np.empty((words.shape[0], words.shape[1], 8), np.int64)
    codes[..., AUTOAWQ_ORDER] = fields
    return codes.reshape(words.shape[0], -1)


def numpy_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` (fp32) of an AWQ GEMM layer: ``(q[k, n] - zero[k // G, n]) * scale[k // G, n]``."""
    codes, zeros = numpy_unpack(qweight), numpy_unpack(qzeros)
    group = np.arange(codes.shape[0]) // (codes.shape[0] // zeros.shape[0])
    weight = (codes - zeros[group]) * scales.float().numpy()[group]
    return torch.from_numpy(weight.T.astype(np.float32))


def dequantized_state(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with each AWQ projection as its fp32 ``weight`` (by :func:`numpy_dequantize`)."""
    state = load_file(f'{path}/model.safetensors')
    out = {name: t for name, t in state.items() if not name.endswith(('qweight', 'qzeros', 'scales'))}
    for name in state:
        if name.endswith('.qweight'):
            module = name.removesuffix('.qweight')
            out[f'{module}.weight'] = numpy_dequantize(state[name], state[f'{module}.qzeros'],
                                                       state[f'{module}.scales'])
    return out


def dequantized_model(source: str, path: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(dequantized_state(path), strict=False)
    assert not unexpected and all(name == 'lm_head.weight' for name in missing)  # tied embeddings
    return model


@pytest.mark.parametrize('shape,group_size', [((64, 256), 128), ((40, 96), 32)])
def test_packing_reads_back_by_a_numpy_unpacker(shape, group_size):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(group_size)) * 0.1
    weight[:, 5] *= 20  # a group with a wide range
    tensors = awq_tensors(weight, group_size)
    assert tensors['qweight'].dtype == torch.int32 and tensors['qweight'].shape == (shape[1], shape[0] // 8)
    assert tensors['scales'].dtype == torch.float16 and tensors['scales'].shape == (shape[1] // group_size, shape[0])
    unpacked = numpy_dequantize(**tensors)
    assert torch.equal(unpacked, fake_quantize(weight, group_size))
    steps = tensors['scales'].float().T.repeat_interleave(group_size, 1)
    assert ((unpacked - weight).abs() <= steps * 0.51).all()  # round to nearest on the fp16 step


def test_packing_reads_back_by_autoawq():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    tensors = awq_tensors(weight, 128)
    assert torch.equal(awq_dequantized(tensors, 128), numpy_dequantize(**tensors))


@pytest.fixture(scope='module', params=['llama', 'qwen2', 'qwen3'])
def awq_model(request, tmp_path_factory) -> tuple[str, str, int]:
    """A tiny random model (Llama with GQA at group size 128; Qwen2 with q/k/v biases and Qwen3 with q/k
    norms at 32) and its ``lmdeploy lite auto_awq`` copy, made through the CLI."""
    kind = request.param
    group_size = 128 if kind == 'llama' else 32
    source = save_tiny_model(kind, str(tmp_path_factory.mktemp(kind)), **(QUANT_LLAMA if kind == 'llama' else {}))
    out = str(tmp_path_factory.mktemp(f'{kind}_awq'))
    main(['lite', 'auto_awq', source, out, '--w-group-size', str(group_size), '--calib-samples', '4',
          '--calib-seqlen', '128'])
    return source, out, group_size


def test_checkpoint_is_autoawqs_gemm_layout(awq_model):
    source, out, group_size = awq_model
    config = json.loads(open(f'{out}/config.json').read())
    assert config['quantization_config'] == {'quant_method': 'awq', 'bits': 4, 'group_size': group_size,
                                             'zero_point': True, 'version': 'gemm', 'calibration_tokens': 512}
    read = AwqConfig.from_dict(AutoConfig.from_pretrained(out).quantization_config)
    assert (read.bits, read.group_size, read.zero_point, read.format) == (4, group_size, True, 'gemm')
    state, original = load_file(f'{out}/model.safetensors'), load_file(f'{source}/model.safetensors')
    for proj in PROJECTIONS:
        module = f'model.layers.1.{"mlp" if proj in MLP else "self_attn"}.{proj}'
        n, k = original[f'{module}.weight'].shape
        assert f'{module}.weight' not in state
        assert state[f'{module}.qweight'].shape == (k, n // 8) and state[f'{module}.qweight'].dtype == torch.int32
        assert state[f'{module}.qzeros'].shape == (k // group_size, n // 8)
        assert state[f'{module}.scales'].shape == (k // group_size, n)
    norm = 'model.layers.0.input_layernorm.weight'
    assert not torch.equal(state[norm], original[norm])  # the scales are folded into it


def test_loads_without_a_flag_and_matches_transformers_on_the_unpacked_weights(awq_model):
    """fp32 greedy tokens equal transformers' on the weights the numpy unpacker reads from the checkpoint,
    and the logits stay close to the unquantized model's."""
    source, out, _ = awq_model
    prompts = random_prompts([5, 23], seed=4)
    engine = make_engine(out)
    try:
        assert isinstance(engine.runner.model.layers[0].mlp.down_proj.weight_format, AwqFormat)
        outs = run(engine, prompts)
        logits = engine.get_logits(prompts[1])
    finally:
        engine.close()
    hf = dequantized_model(source, out)
    assert_transformers_greedy(hf, prompts, outs)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[1]])).logits[0]
    # measured 0.26 (llama), 0.09 (qwen2), 0.17 (qwen3): 4-bit codes of N(0, 0.2) random weights are each
    # about 10% off, and these models amplify it; wrong scales or a misplaced nibble give errors near 1
    assert ((logits.float() - expected).norm() / expected.norm()).item() < 0.4


def test_wrong_group_size_and_bits_are_refused(tmp_path):
    source = save_tiny_model('llama', str(tmp_path / 'src'))
    with pytest.raises(ValueError, match='groups of 48'):
        auto_awq(source, str(tmp_path / 'out'), w_group_size=48)
    with pytest.raises(ValueError, match='not 8'):
        auto_awq(source, str(tmp_path / 'out'), w_bits=8)
    with pytest.raises(SystemExit):
        main(['lite', 'auto_awq', source, str(tmp_path / 'out'), '--w-bits', '8'])


@pytest.mark.parametrize('flags, message', [(['--w-group-size', '0'], 'w_group_size must be at least 1, got 0'),
                                           (['--calib-samples', '0'], 'calib_samples must be at least 1, got 0')])
def test_cli_refuses_bad_arguments_in_one_line_before_any_work(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(['lite', 'auto_awq', str(tmp_path / 'no-model-read'), str(tmp_path / 'out'), *flags])
    assert exited.value.code == 2 and capsys.readouterr().err.strip() == f'lmdeploy: error: {message}'


def _logits_error(source: str, path: str, ids: torch.Tensor) -> float:
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()(ids).logits
        got = dequantized_model(source, path)(ids).logits
    return ((got - expected).norm() / expected.norm()).item()


def test_search_beats_round_to_nearest_on_outlier_channels(tmp_path):
    """Activations with a few channels 20x the rest (RMSNorm weights, as trained LLMs have): the searched
    scales quantize the weights those channels read more finely than plain round to nearest does."""
    source = save_tiny_model('llama', str(tmp_path / 'src'), **QUANT_LLAMA)
    state = load_file(f'{source}/model.safetensors')
    outliers = torch.randperm(256, generator=torch.Generator().manual_seed(0))[:6]
    for name in state:
        if name.endswith('layernorm.weight'):
            state[name][outliers] *= 20
    save_file(state, f'{source}/model.safetensors', metadata={'format': 'pt'})
    auto_awq(source, str(tmp_path / 'awq'), calib_samples=4, calib_seqlen=128)
    auto_awq(source, str(tmp_path / 'rtn'), search_scale=False, apply_clip=False)
    # held out: calibration reads the text's first 512 tokens
    from transformers import AutoTokenizer
    ids = torch.tensor([AutoTokenizer.from_pretrained(source)(calibration_text())['input_ids'][-256:]])
    awq, rtn = _logits_error(source, str(tmp_path / 'awq'), ids), _logits_error(source, str(tmp_path / 'rtn'), ids)
    assert awq < 0.8 * rtn, (awq, rtn)  # measured 0.37 against 0.61 (0.36 unclipped)


def _reference_scales(layer: torch.nn.Module, inputs: dict, attn_kwargs: dict, config: dict,
                      group_size: int) -> dict[str, torch.Tensor]:
    """The scale search written plainly: for each ratio the group's linears hold ``Q(W * s) / s`` and the
    whole block (attention, o_proj, MLP, down_proj) runs again; the least mean squared error against the
    block's unquantized output wins."""
    group, head_dim = attention_shape(config)
    attn, mlp = layer.self_attn, layer.mlp

    def per_kv_head(s: torch.Tensor) -> torch.Tensor:
        return expand_kv(s, group, head_dim)

    searches = {'input_layernorm': (lambda x: attn(hidden_states=x, **attn_kwargs)[0],
                                    [attn.q_proj, attn.k_proj, attn.v_proj], 'self_attn.q_proj', None),
                'self_attn.v_proj': (attn.o_proj, [attn.o_proj], 'self_attn.o_proj', per_kv_head),
                'post_attention_layernorm': (mlp, [mlp.gate_proj, mlp.up_proj], 'mlp.gate_proj', None),
                'mlp.up_proj': (mlp.down_proj, [mlp.down_proj], 'mlp.down_proj', None)}
    chosen = {}
    for key, (block, linears, name, expand) in searches.items():
        x = inputs[name]
        x_mean = x.abs().reshape(-1, x.shape[-1]).mean(0)
        x_mean = kv_shared(x_mean, group, head_dim, 'mean') if expand else x_mean
        expected, originals, tried = block(x), [linear.weight.data for linear in linears], []
        for step in range(21):
            s = x_mean.pow(step / 20).clamp_min(1e-4)
            s = s / (s.max() * s.min()).sqrt()
            full = expand(s) if expand else s
            for linear, weight in zip(linears, originals):
                linear.weight.data = fake_quantize(weight * full, group_size) / full
            tried.append(((block(x) - expected).pow(2).mean().item(), step, s))
        for linear, weight in zip(linears, originals):
            linear.weight.data = weight
        chosen[key] = min(tried, key=lambda t: t[0])
    return chosen


@pytest.mark.parametrize('kind', ['llama', 'qwen2', 'qwen3'])
@torch.no_grad()
def test_search_chooses_the_scales_of_a_plain_evaluation(kind, tmp_path):
    """On every layer of models with outlier channels (Llama with GQA, Qwen2 with q/k/v biases, Qwen3 with
    q/k norms) the search's error on the linears' outputs (q/k/v through the attention; bf16 products)
    picks the ratio that running the quantized blocks picks, and not only ratio 0 (plain rounding)."""
    source = save_tiny_model(kind, str(tmp_path / 'src'), **(QUANT_LLAMA if kind == 'llama' else {}))
    state = load_file(f'{source}/model.safetensors')
    hidden = state['model.norm.weight'].numel()
    outliers = torch.randperm(hidden, generator=torch.Generator().manual_seed(0))[:hidden // 40]
    for name in state:
        if name.endswith('layernorm.weight'):
            state[name][outliers] *= 20
    save_file(state, f'{source}/model.safetensors', metadata={'format': 'pt'})
    path, config = load_source(source, 'auto_awq')
    group_size = 128 if kind == 'llama' else 32
    layers = auto_awq_module._calibration_layers(load_float_model(path), calibration_ids(path, 512).view(4, 128))
    steps = []
    for layer, inputs, attn_kwargs in layers:
        fast = search_scales(layer, inputs, attn_kwargs, config, group_size)
        for key, (_, step, s) in _reference_scales(layer, inputs, attn_kwargs, config, group_size).items():
            assert torch.equal(fast[key], s), (key, step)
            steps.append(step)
    assert any(steps), steps


def _outlier_layer(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[64, 256]`` with 1% of its entries 8x the rest and inputs ``[tokens, 256]`` with four
    channels 10x the rest (the same channels and weight for every ``tokens``)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=g) * 0.05
    weight[torch.rand(64, 256, generator=g) < 0.01] *= 8
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed))
    x[:, [3, 70, 140, 200]] *= 10
    return weight, x


def _row_errors(weight: torch.Tensor, quantized: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per output, the mean squared error of ``x @ quantized.T`` against ``x @ weight.T`` (in fp64)."""
    return ((x.double() @ quantized.double().T - x.double() @ weight.double().T) ** 2).mean(0)


def test_clipping_never_raises_a_layers_output_error(monkeypatch):
    """On its calibration tokens no output's error grows, the layer's falls; each group is its weights clamped
    to a symmetric bound; output-channel chunks do not change the result; held-out tokens gain too."""
    weight, x = _outlier_layer(512, seed=1)
    clipped = clip_weight(weight, x, 32)
    plain = _row_errors(weight, fake_quantize(weight, 32), x)
    narrowed = _row_errors(weight, fake_quantize(clipped, 32), x)
    assert (narrowed <= plain * (1 + 1e-6)).all()
    assert narrowed.sum() < 0.9 * plain.sum(), (narrowed.sum() / plain.sum()).item()  # measured 0.75
    bound = clipped.view(64, 8, 32).abs().amax(-1, keepdim=True)
    assert torch.equal(clipped, weight.view(64, 8, 32).clamp(-bound, bound).view(64, 256))
    assert (bound < weight.view(64, 8, 32).abs().amax(-1, keepdim=True)).float().mean() > 0.25
    monkeypatch.setattr(auto_awq_module, 'CLIP_CHUNK', 24 * 256)  # chunks of 24 outputs, the last one short
    assert torch.equal(clip_weight(weight, x, 32), clipped)
    _, held_out = _outlier_layer(512, seed=2)
    assert (_row_errors(weight, fake_quantize(clipped, 32), held_out).sum()
            < _row_errors(weight, fake_quantize(weight, 32), held_out).sum())


def test_clipping_leaves_q_and_k_and_can_be_turned_off(awq_model, tmp_path):
    """``--no-apply-clip`` gives the same q/k codes (never clipped) and different codes for the clipped
    projections of every layer."""
    source, out, group_size = awq_model
    unclipped = str(tmp_path / 'unclipped')
    main(['lite', 'auto_awq', source, unclipped, '--w-group-size', str(group_size), '--calib-samples', '4',
          '--calib-seqlen', '128', '--no-apply-clip'])
    state, other = load_file(f'{out}/model.safetensors'), load_file(f'{unclipped}/model.safetensors')
    for layer in range(json.loads(open(f'{source}/config.json').read())['num_hidden_layers']):
        for proj in PROJECTIONS:
            name = f'model.layers.{layer}.{"mlp" if proj in MLP else "self_attn"}.{proj}.qweight'
            assert torch.equal(state[name], other[name]) == (proj in ('q_proj', 'k_proj')), name
