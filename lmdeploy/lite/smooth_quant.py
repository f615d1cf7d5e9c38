"""SmoothQuant W8A8 checkpoints (Xiao et al., 2023), written for the engine's ``smooth_quant`` weight format.

Per input channel ``j`` of each projection, SmoothQuant picks ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``,
which moves the activations' outlier channels into the weights, so that both quantize to int8 with little
error; ``X / s`` is folded into what produces ``X`` (:mod:`lmdeploy.lite.calibration`). Then every
projection's weight is quantized to int8 with one symmetric scale per output channel.
"""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.lite import CALIBRATION_TOKENS
from lmdeploy.lite.calibration import (PROJECTIONS, attention_shape, calibration_ids, check_arguments, fold_norm,
                                       fold_pair, is_projection, kv_shared, load_float_model, load_float_state,
                                       load_source, write_checkpoint)
from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.kernels.w8a8 import quantize_weight

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


def smooth(state: dict[str, torch.Tensor], act_scales: dict[str, torch.Tensor], config: dict,
           alpha: float = 0.5) -> None:
    """Smooths the fp32 Hugging Face ``state`` of a Llama-style model in place (see the module's docstring);
    ``act_scales`` from :func:`collect_act_scales` on the same model."""
    group, head_dim = attention_shape(config)
    for i in range(config['num_hidden_layers']):
        attn, mlp = f'model.layers.{i}.self_attn', f'model.layers.{i}.mlp'
        for norm, projections in (('input_layernorm', [f'{attn}.q_proj', f'{attn}.k_proj', f'{attn}.v_proj']),
                                  ('post_attention_layernorm', [f'{mlp}.gate_proj', f'{mlp}.up_proj'])):
            weight_peak = torch.cat([state[f'{name}.weight'] for name in projections]).abs().amax(0)
            s = _factors(act_scales[projections[0]], weight_peak, alpha)
            fold_norm(state, f'model.layers.{i}.{norm}', projections, s)
        o_peak = kv_shared(state[f'{attn}.o_proj.weight'].abs().amax(0), group, head_dim, 'amax')
        s = _factors(kv_shared(act_scales[f'{attn}.o_proj'], group, head_dim, 'amax'), o_peak, alpha)
        fold_pair(state, f'{attn}.v_proj', f'{attn}.o_proj', s, group, head_dim)
        intermediate = state[f'{mlp}.up_proj.weight'].shape[0]
        s = _factors(act_scales[f'{mlp}.down_proj'], state[f'{mlp}.down_proj.weight'].abs().amax(0), alpha)
        fold_pair(state, f'{mlp}.up_proj', f'{mlp}.down_proj', s, 1, intermediate)


def quantize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every decoder projection's weight as int8 ``weight`` plus fp32 ``scale [out, 1]``."""
    out = {}
    for name, tensor in state.items():
        if is_projection(name):
            out[name], out[name.removesuffix('weight') + 'scale'] = quantize_weight(tensor)
        else:
            out[name] = tensor
    return out


def smooth_quant(model_path: str, out_dir: str, alpha: float = 0.5, calib_tokens: int = CALIBRATION_TOKENS,
                 seq_len: int = 512) -> None:
    """Writes a W8A8 copy of ``model_path`` (a Hugging Face folder or a .gguf file) to ``out_dir``, calibrated
    on the first ``calib_tokens`` tokens of the shipped text (:func:`lmdeploy.lite.calibration_text`) in fp32
    with transformers on the CPU. ``alpha`` is in [0, 1]."""
    if not 0 <= alpha <= 1:
        raise ConfigError(f'alpha must be in [0, 1], got {alpha}')
    check_arguments(out_dir, calib_tokens=calib_tokens, seq_len=seq_len)
    source, config = load_source(model_path, 'smooth_quant')
    input_ids = calibration_ids(source, calib_tokens)
    act_scales = collect_act_scales(load_float_model(source), input_ids, seq_len)
    state = load_float_state(source)
    smooth(state, act_scales, config, alpha)
    write_checkpoint(source, out_dir, quantize(state), config,
                     dict(QUANTIZATION_CONFIG, alpha=alpha, calibration_tokens=int(input_ids.numel())))
