"""Rotary scaling that llama.cpp keeps as tensors, back in transformers' ``rope_parameters``.

Phi-3's LongRoPE factors are two tensors. For ``rope_type: llama3`` (Llama 3.1, 3.2, 3.3) the converter
writes no metadata at all, only the per-frequency divisors ``rope_freqs.weight``: :func:`llama3_rope` finds
the ``llama3`` parameters that give exactly those divisors, so the converted folder is a plain transformers
checkpoint.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lmdeploy.messages import ConfigError

ROPE_FREQS = 'rope_freqs.weight'
LONGROPE_FACTORS = ('rope_factors_long.weight', 'rope_factors_short.weight')
ROTARY_TENSORS = (*LONGROPE_FACTORS, ROPE_FREQS)
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_CONTEXT = 1.0, 4.0, 8192


def phi3_rope(key: Callable[[str], Any], tensors: dict[str, Any], head_dim: int, source: str) -> dict[str, Any]:
    """Phi-3's config fields that llama.cpp keeps elsewhere: the rotating share of each head, the sliding
    window and the LongRoPE factors. ``key`` reads one of the file's ``phi3.*`` metadata."""
    params = {'rope_theta': key('rope.freq_base') or 10000.0,
              'partial_rotary_factor': (key('rope.dimension_count') or head_dim) / head_dim}
    config = {'rope_parameters': params, 'sliding_window': key('attention.sliding_window')}
    if LONGROPE_FACTORS[0] in tensors:
        original = key('rope.scaling.original_context_length')
        if original is None:
            raise ConfigError(f'{source}: missing GGUF metadata: phi3.rope.scaling.original_context_length')
        factors = [np.asarray(tensors[name].data, dtype=np.float32).tolist() for name in LONGROPE_FACTORS]
        params |= {'rope_type': 'longrope', 'long_factor': factors[0], 'short_factor': factors[1],
                   'original_max_position_embeddings': original}
        if key('rope.scaling.attn_factor') is not None:
            params['attention_factor'] = key('rope.scaling.attn_factor')
        config['original_max_position_embeddings'] = original
    return config


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int, source: str) -> dict[str, Any]:
    """The ``rope_parameters`` whose ``llama3`` frequencies equal ``theta``'s divided by ``factors`` (one per
    rotating pair of features); ValueError when no ``llama3`` parameters do."""
    factors = np.asarray(factors, dtype=np.float64)
    dim = 2 * len(factors)
    if dim != head_dim:
        raise ValueError(f'{source}: {ROPE_FREQS} has {len(factors)} factors for heads of {head_dim} features; '
                         'Llama 3 scaling rotates whole heads')
    base = theta ** -(np.arange(0, dim, 2) / dim)
    wavelengths = 2 * math.pi / base
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return {'rope_type': 'default', 'rope_theta': theta}
    for low, high, context in _candidates(factors, factor, wavelengths):
        params = {'rope_type': 'llama3', 'rope_theta': theta, 'factor': factor, 'low_freq_factor': low,
                  'high_freq_factor': high, 'original_max_position_embeddings': context}
        if _reproduces(params, base / factors):
            return params
    raise ValueError(f'{source}: the {ROPE_FREQS} factors are not Llama 3 rotary scaling; this file cannot be '
                     'served exactly')


def _candidates(factors: np.ndarray, factor: float, wavelengths: np.ndarray) -> list[tuple[float, float, int]]:
    """Parameter sets to try: Llama 3's own low/high factors (1, 4) with the context the divisors imply, Llama 4's
    (1, 1) where they step from 1 to ``factor`` at once, then a straight-line fit of the smoothed divisors (only
    the wavelength thresholds matter, not the context)."""
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    between = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if between.any():
        implied = wavelengths[between] * (smooth[between] * (_LLAMA3_HIGH - _LLAMA3_LOW) + _LLAMA3_LOW)
        context = float(np.median(implied))
    else:
        unscaled = wavelengths[factors <= 1 + 1e-6]
        scaled = wavelengths[factors >= factor - 1e-6]
        top = scaled.min() * _LLAMA3_LOW
        bottom = unscaled.max() * _LLAMA3_HIGH if len(unscaled) else top / 2
        context = (bottom + top) / 2
    candidates = [(_LLAMA3_LOW, _LLAMA3_HIGH, round(context))]
    if not between.any() and (factors <= 1 + 1e-6).any():
        # a step at one wavelength (Llama 4: low and high factor 1): the first power of two past the unscaled ones
        unscaled = wavelengths[factors <= 1 + 1e-6].max()
        candidates.append((_LLAMA3_LOW, _LLAMA3_LOW, 2**math.ceil(math.log2(unscaled))))
    if between.sum() >= 2:
        slope, intercept = np.polyfit(_LLAMA3_CONTEXT / wavelengths[between], smooth[between], 1)
        low = -intercept / slope  # rounded: the fit's last digits are float32 noise
        candidates.append((round(float(low), 4), round(float(low + 1 / slope), 4), _LLAMA3_CONTEXT))
    return candidates


def _reproduces(params: dict[str, Any], expected: np.ndarray) -> bool:
    dim = 2 * len(expected)
    config = LlamaConfig(hidden_size=dim, num_attention_heads=1, head_dim=dim, rope_parameters=dict(params),
                         max_position_embeddings=2 * params['original_max_position_embeddings'])
    inv_freq, _ = ROPE_INIT_FUNCTIONS['llama3'](config, torch.device('cpu'))
    return np.allclose(inv_freq.double().numpy(), expected, rtol=1e-5, atol=0)
