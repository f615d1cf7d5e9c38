"""4-bit checkpoints for the tests, and the independent unpackers they are checked against: AutoAWQ's
``awq/utils/packing_utils.py`` and AutoGPTQ's ``QuantLinear`` (``qlinear_cuda.py``, whose torch path runs
on the CPU), loaded from their installed packages without their package ``__init__`` (which needs CUDA
builds and older transformers). Install them with ``pip install --no-deps autoawq auto-gptq``."""
from __future__ import annotations

import importlib.util
import json
import os
import zlib
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output of each field, as AutoAWQ packs


def reference_module(package: str, path: str) -> ModuleType:
    """``path`` of an installed ``package``, imported on its own; skips the test without the package."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f'{package} is not installed (pip install --no-deps autoawq auto-gptq)')
    module_spec = importlib.util.spec_from_file_location(f'_reference_{package}',
                                                         os.path.join(spec.submodule_search_locations[0], path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def awq_reference() -> ModuleType:
    return reference_module('awq', 'utils/packing_utils.py')


def gptq_reference() -> ModuleType:
    return reference_module('auto_gptq', 'nn_modules/qlinear/qlinear_cuda.py')


def random_grid(out_features: int, in_features: int, group_size: int, seed: int, min_zero: int = 0):
    """Codes ``[N, K]``, integer zero points and fp16 scales ``[N, K / G]`` of a random 4-bit weight."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    zeros = torch.randint(min_zero, 16, (out_features, groups), generator=g)
    scales = (torch.rand(out_features, groups, generator=g) * 0.05 + 0.01).half()
    return codes, zeros, scales


def to_int32(packed: torch.Tensor) -> torch.Tensor:
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, N]`` codes as AWQ's ``[rows, N / 8]`` int32 (this test's own packer)."""
    fields = codes.long().view(codes.shape[0], -1, 8)[..., AWQ_ORDER]
    return to_int32((fields << torch.arange(0, 32, 4)).sum(-1))


def awq_tensors(codes, zeros, scales, group_size) -> dict[str, torch.Tensor]:
    """An AWQ GEMM layer's checkpoint tensors for the grid of :func:`random_grid`."""
    return {'qweight': pack_awq(codes.T), 'qzeros': pack_awq(zeros.T), 'scales': scales.T.contiguous()}


def awq_dequantized(tensors: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """``W [N, K]`` (fp32) by AutoAWQ's unpacker."""
    ref = awq_reference()
    return ref.dequantize_gemm(tensors['qweight'], tensors['qzeros'], tensors['scales'].float(), 4, group_size).T


def gptq_layer(codes, zeros, scales, group_size, g_idx=None):
    """AutoGPTQ's ``QuantLinear`` packed by AutoGPTQ from the grid (``g_idx``: each input's group)."""
    ref = gptq_reference()
    out_features, in_features = codes.shape
    layer = ref.QuantLinear(4, group_size, in_features, out_features, False, weight_dtype=torch.float32)
    g_idx = g_idx if g_idx is not None else torch.arange(in_features) // group_size
    scales = scales.float()
    weight = (codes - zeros[:, g_idx]).float() * scales[:, g_idx]
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = weight
    layer.pack(linear, scales, zeros.float(), g_idx.int())
    return layer


def gptq_tensors(layer) -> dict[str, torch.Tensor]:
    return {'qweight': layer.qweight, 'qzeros': layer.qzeros, 'scales': layer.scales.half(),
            'g_idx': layer.g_idx.int()}


def gptq_dequantized(layer) -> torch.Tensor:
    """``W [N, K]`` (fp32) by AutoGPTQ's own torch path (``x @ W.T`` with ``x`` the identity)."""
    with torch.no_grad():
        return layer(torch.eye(layer.infeatures)).T


def quantize_grid(weight: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None):
    """Round-to-nearest 4-bit grid of ``weight [N, K]`` (min/max per group; ``g_idx``: each input's group)
    with zero points in 1-15, so that AutoGPTQ's off-by-one storage can hold them."""
    out_features, in_features = weight.shape
    g_idx = g_idx if g_idx is not None else torch.arange(in_features) // group_size
    order = torch.argsort(g_idx, stable=True)
    grouped = weight[:, order].view(out_features, -1, group_size)
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scales = ((high - low) / 14).clamp_min(1e-4).half()
    zeros = (1 - low / scales.float()).round().clamp(1, 15).long()
    codes = (weight / scales.float()[:, g_idx] + zeros[:, g_idx]).round().clamp(0, 15).long()
    return codes, zeros, scales


PROJECTIONS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', 'w1', 'w2', 'w3')


def quantize_checkpoint(src: str, dst: str, method: str, group_size: int, desc_act: bool = False) -> str:
    """``src`` (an fp32 transformers folder) with every decoder projection (the experts' too, not the routers)
    quantized in the ``method`` (``awq`` or ``gptq``) checkpoint layout into ``dst``; returns ``dst``. A
    ``dequantized.safetensors`` beside it holds those weights as the independent unpacker reads them back."""
    state = load_file(os.path.join(src, 'model.safetensors'))
    out, dequantized = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix('.weight')
        if not name.endswith('.weight') or module.rpartition('.')[2] not in PROJECTIONS:
            out[name] = tensor
            continue
        # GPTQ orders a layer's inputs by its Hessian, the same for projections of the same input
        parent, _, proj = module.rpartition('.')
        shared = {'q_proj': 'qkv', 'k_proj': 'qkv', 'v_proj': 'qkv', 'gate_proj': 'gate_up', 'up_proj': 'gate_up',
                  'w1': 'gate_up', 'w3': 'gate_up'}
        g = torch.Generator().manual_seed(zlib.crc32(f'{parent}.{shared.get(proj, proj)}'.encode()))
        g_idx = torch.randperm(tensor.shape[1], generator=g) // group_size if desc_act else None
        codes, zeros, scales = quantize_grid(tensor, group_size, g_idx)
        if method == 'awq':
            tensors = awq_tensors(codes, zeros, scales, group_size)
            dequantized[name] = awq_dequantized(tensors, group_size)
        else:
            layer = gptq_layer(codes, zeros, scales, group_size, g_idx)
            tensors = gptq_tensors(layer)
            dequantized[name] = gptq_dequantized(layer)
        dequantized[name] = dequantized[name].contiguous()
        out.update({f'{module}.{kind}': value.contiguous() for kind, value in tensors.items()})
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, 'model.safetensors'), metadata={'format': 'pt'})
    save_file(dequantized, os.path.join(dst, 'dequantized.safetensors'))
    for name in os.listdir(src):
        if name != 'model.safetensors' and os.path.isfile(os.path.join(src, name)):
            with open(os.path.join(src, name), 'rb') as f, open(os.path.join(dst, name), 'wb') as g:
                g.write(f.read())
    with open(os.path.join(dst, 'config.json')) as f:
        config = json.load(f)
    config['quantization_config'] = ({'quant_method': 'awq', 'bits': 4, 'group_size': group_size,
                                      'zero_point': True, 'version': 'gemm'} if method == 'awq' else
                                     {'quant_method': 'gptq', 'bits': 4, 'group_size': group_size,
                                      'desc_act': desc_act, 'sym': False, 'checkpoint_format': 'gptq'})
    with open(os.path.join(dst, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    return dst
