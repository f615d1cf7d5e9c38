"""Builds a model on its device: from its weight files, or with random weights (``load_format='dummy'``)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lmdeploy.archs import get_model_class
from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import WeightFormat, cast_model, defer_weights, use_weight_format, weight_format_for
from lmdeploy.pytorch.weights.safetensors_loader import iterate_weights, one_thread

DUMMY_STD = 0.02


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of a trained model's scale: matrices ``N(0, 0.02)``, biases 0, norm weights 1; a quantized
    format's integer codes and scales 0 (an MXFP4 weight of 0: the kernels run as on real weights)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            param.zero_()
        elif param.dim() >= 2:
            param.normal_(0.0, DUMMY_STD, generator=generator)
        elif name.endswith('bias'):
            param.zero_()
        else:
            param.fill_(1.0)


def checkpoint_quantization(cfg: ModelConfig) -> dict | None:
    """The checkpoint's ``quantization_config``: a vision-language model's at the top of its config (its
    language model's layers; the tower's are plain ``nn.Linear``), else the language model's."""
    return (getattr(cfg.mm_config, 'quantization_config', None) or
            getattr(cfg.hf_config, 'quantization_config', None))


def _new_model(cfg: ModelConfig, weight_format: WeightFormat) -> nn.Module:
    """The model of ``cfg``, each linear layer and MoE layer's experts in its format of ``weight_format``
    (built with their parameters deferred, then created in the format their name picks: a dense copy of
    experts kept as blocks is never reserved)."""
    with use_weight_format(weight_format), defer_weights():
        model = get_model_class(cfg.architecture)(cfg)
    for name, module in model.named_modules():
        if isinstance(module, (Linear, FusedExperts)):
            built = module.weight_format
            module.set_weight_format(weight_format.layer_format(name, module) if built is weight_format else built)
    deferred = [name for name, param in model.named_parameters() if param.is_meta]
    if deferred:
        raise RuntimeError(f'parameters left on the meta device after building the model: {deferred[:5]}')
    return model


def build_model(cfg: ModelConfig, model_dir: str, device: torch.device, load_format: str = 'auto',
                show_progress: bool = True) -> nn.Module:
    """The model for ``cfg`` on ``device`` in ``cfg.dtype``, in eval mode.

    Linear layers take the weight format of the checkpoint's ``quantization_config`` (each its own, for
    checkpoints whose layers differ). ``auto`` reads
    the folder's weight files; ``dummy`` allocates the model on the device directly and
    fills it with :func:`fill_dummy_weights` (no host copy: an 8B model takes seconds).
    """
    try:
        weight_format = weight_format_for(checkpoint_quantization(cfg))
    except ValueError as err:
        raise ConfigError(f'{model_dir}/config.json: its quantization_config is not served: {err}') from err
    if load_format == 'dummy':
        with torch.no_grad(), _default_dtype(cfg.dtype), device:
            model = _new_model(cfg, weight_format)
            fill_dummy_weights(model)
        return model.eval()
    model = cast_model(_new_model(cfg, weight_format), cfg.dtype)
    with one_thread():
        model.load_weights(weight_format.convert_checkpoint(iterate_weights(model_dir, show_progress)))
    return model.to(device).eval()
