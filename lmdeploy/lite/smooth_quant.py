"""SmoothQuant W8A8 checkpoints (Xiao et al., 2023), written for the engine's ``smooth_quant`` weight format.

A linear layer's input ``X`` and weight ``W`` give the same product as ``X / s`` and ``W * s`` (``s`` per
input channel). SmoothQuant picks ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``, which moves the
activations' outlier channels into the weights, so that both quantize to int8 with little error. The
division is folded into what produces ``X``: the RMSNorm weights before q/k/v and gate/up, v_proj's
rows before o_proj (one factor per KV-head channel, shared by the query heads that read it), up_proj's
rows before down_proj. The smoothed model computes what the original does (exactly, in real numbers);
then every projection's weight is quantized to int8 with one symmetric scale per output channel.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lmdeploy.lite import CALIBRATION_TOKENS, calibration_text
from lmdeploy.pytorch.kernels.w8a8 import quantize_weight

SUPPORTED_ARCHITECTURES = ('LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM')
PROJECTIONS = ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'self_attn.o_proj', 'mlp.gate_proj',
               'mlp.up_proj', 'mlp.down_proj')
QUANTIZATION_CONFIG = {'quant_method': 'smooth_quant', 'quant_dtype': 'int8'}
MIN_SCALE = 1e-5


@torch.no_grad()
def collect_act_scales(model: nn.Module, input_ids: torch.Tensor, seq_len: int = 512) -> dict[str, torch.Tensor]:
    """The largest magnitude of each input channel of every decoder projection (``model.layers.<i>.<proj>``)
    over ``input_ids`` (1-D), run through a transformers causal LM in chunks of ``seq_len`` tokens."""
    scales: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            peak = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            scales[name] = peak if name not in scales else torch.maximum(scales[name], peak)
        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.endswith(PROJECTIONS)]
    try:
        for start in range(0, input_ids.numel(), seq_len):
            model(input_ids[start:start + seq_len][None])
    finally:
        for handle in handles:
            handle.remove()
    return scales


def _factors(act: torch.Tensor, weight_peak: torch.Tensor, alpha: float) -> torch.Tensor:
    act, weight_peak = act.clamp_min(MIN_SCALE), weight_peak.clamp_min(MIN_SCALE)
    return (act.pow(alpha) / weight_peak.pow(1 - alpha)).clamp_min(MIN_SCALE)


def _smooth_norm(state: dict[str, torch.Tensor], norm: str, projections: list[str], act: torch.Tensor,
                 alpha: float) -> None:
    weights = [state[f'{name}.weight'] for name in projections]
    s = _factors(act, torch.cat(weights).abs().amax(0), alpha)
    state[f'{norm}.weight'] = state[f'{norm}.weight'] / s
    for name, weight in zip(projections, weights):
        state[f'{name}.weight'] = weight * s


def _smooth_pair(state: dict[str, torch.Tensor], first: str, second: str, act: torch.Tensor, alpha: float,
                 head_dim: int, group: int) -> None:
    """Divides ``first``'s output rows and multiplies ``second``'s input columns. Input channel ``(h, d)`` of
    ``second`` reads row ``(h // group, d)`` of ``first`` (grouped-query attention, v_proj -> o_proj: each
    KV head's factors are shared by the ``group`` query heads that read it)."""
    first_weight, second_weight = state[f'{first}.weight'], state[f'{second}.weight']
    kv_heads = first_weight.shape[0] // head_dim

    def peak(columns: torch.Tensor) -> torch.Tensor:
        return columns.view(kv_heads, group, head_dim).amax(1).reshape(-1)

    s = _factors(peak(act), peak(second_weight.abs().amax(0)), alpha)
    state[f'{first}.weight'] = first_weight / s[:, None]
    if f'{first}.bias' in state:
        state[f'{first}.bias'] = state[f'{first}.bias'] / s
    state[f'{second}.weight'] = second_weight * s.view(kv_heads, 1, head_dim).expand(-1, group, -1).reshape(-1)


def smooth(state: dict[str, torch.Tensor], act_scales: dict[str, torch.Tensor], config: dict,
           alpha: float = 0.5) -> None:
    """Smooths the fp32 Hugging Face ``state`` of a Llama-style model in place (see the module's docstring);
    ``act_scales`` from :func:`collect_act_scales` on the same model."""
    heads, kv_heads = config['num_attention_heads'], config.get('num_key_value_heads', config['num_attention_heads'])
    head_dim = config.get('head_dim') or config['hidden_size'] // heads
    for i in range(config['num_hidden_layers']):
        layer = f'model.layers.{i}'
        attn, mlp = f'{layer}.self_attn', f'{layer}.mlp'
        _smooth_norm(state, f'{layer}.input_layernorm', [f'{attn}.{p}' for p in ('q_proj', 'k_proj', 'v_proj')],
                     act_scales[f'{attn}.q_proj'], alpha)
        _smooth_norm(state, f'{layer}.post_attention_layernorm', [f'{mlp}.gate_proj', f'{mlp}.up_proj'],
                     act_scales[f'{mlp}.gate_proj'], alpha)
        _smooth_pair(state, f'{attn}.v_proj', f'{attn}.o_proj', act_scales[f'{attn}.o_proj'], alpha, head_dim,
                     heads // kv_heads)
        intermediate = state[f'{mlp}.up_proj.weight'].shape[0]
        _smooth_pair(state, f'{mlp}.up_proj', f'{mlp}.down_proj', act_scales[f'{mlp}.down_proj'], alpha,
                     intermediate, 1)


def quantize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every decoder projection's weight as int8 ``weight`` plus fp32 ``scale [out, 1]``."""
    out = {}
    for name, tensor in state.items():
        if name.endswith('.weight') and name.removesuffix('.weight').endswith(PROJECTIONS):
            out[name], out[name.removesuffix('weight') + 'scale'] = quantize_weight(tensor)
        else:
            out[name] = tensor
    return out


def smooth_quant(model_path: str, out_dir: str, alpha: float = 0.5, calib_tokens: int = CALIBRATION_TOKENS,
                 seq_len: int = 512) -> None:
    """Writes a W8A8 copy of ``model_path`` (a Hugging Face folder or a .gguf file) to ``out_dir``, calibrated
    on the first ``calib_tokens`` tokens of the shipped text (:func:`lmdeploy.lite.calibration_text`) in fp32
    with transformers on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmdeploy.model_source import resolve_model_path
    from lmdeploy.pytorch.weights.gguf import resolve_gguf
    from lmdeploy.pytorch.weights.safetensors_loader import safetensors_files

    gguf_file = model_path is not None and Path(model_path).suffix == '.gguf'
    # a GGUF file's copy with every tensor dequantized, none kept as llama.cpp's blocks
    source = Path(resolve_gguf(str(Path(model_path).expanduser()), raw_types=()) if gguf_file else
                  resolve_model_path(model_path))
    config = json.loads((source / 'config.json').read_text())
    architecture = (config.get('architectures') or [None])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f'smooth_quant supports {SUPPORTED_ARCHITECTURES}, not {architecture}')
    if config.get('quantization_config'):
        raise ValueError(f'{model_path} is already quantized ({config["quantization_config"].get("quant_method")})')
    tokenizer = AutoTokenizer.from_pretrained(source)
    input_ids = torch.tensor(tokenizer(calibration_text())['input_ids'][:calib_tokens])
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    act_scales = collect_act_scales(model, input_ids, seq_len)
    del model
    state = {}
    for path in safetensors_files(str(source)):
        state.update({name: t.float() if t.is_floating_point() else t for name, t in load_file(path).items()})
    smooth(state, act_scales, config, alpha)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != '.safetensors' and not path.name.endswith('.safetensors.index.json'):
            shutil.copy2(path, out / path.name)
    save_file({k: v.contiguous() for k, v in quantize(state).items()}, str(out / 'model.safetensors'),
              metadata={'format': 'pt'})
    config.pop('gguf_weight_type', None)  # the weights are no longer the GGUF file's 4-bit grid
    config['quantization_config'] = dict(QUANTIZATION_CONFIG, alpha=alpha, calibration_tokens=int(input_ids.numel()))
    (out / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
