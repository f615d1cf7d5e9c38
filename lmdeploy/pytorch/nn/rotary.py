"""Rotary embedding tables; the scaling variants come from transformers' own init functions."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lmdeploy.pytorch.kernels import apply_rotary
from lmdeploy.pytorch.step_context import StepContext

# model type -> the ``mrope_section`` its transformers rotary takes where the config names none
INTERLEAVED_MROPE_SECTIONS = {'qwen3_vl_text': [24, 20, 20], 'qwen3_vl_moe_text': [24, 20, 20],
                              'qwen3_5_text': [11, 11, 10], 'qwen3_5_moe_text': [11, 11, 10],
                              'qwen4_exp_text': [11, 11, 10]}
# the same for models whose sections are consecutive bands (GLM-4.1V, GLM-4.5V)
MROPE_SECTIONS = {'glm4v_text': [8, 12, 12], 'glm4v_moe_text': [8, 12, 12]}


def rotary_dim(hf_config: PretrainedConfig, head_dim: int, layer_type: str | None = None) -> int:
    """How many leading features of each head rotate (``partial_rotary_factor`` of them; of the rope of
    ``layer_type`` where the config has one per layer type: Laguna, MiMo-V2-Flash)."""
    params = getattr(hf_config, 'rope_parameters', None) or {}
    if layer_type is not None:
        params = params[layer_type]
    return int(head_dim * params.get('partial_rotary_factor', 1.0))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotates the first ``cos.shape[-1]`` features of each head of ``x [T, H, D]``, neox layout.

    ``interleaved`` (GLM) rotates pairs of neighbouring features instead: the rotating features are
    regrouped into halves first, and left so. Queries and keys both get the same regrouping, so their
    products, and thus attention, are unchanged.
    """
    dim = cos.shape[-1]
    rot = x[..., :dim]
    if interleaved:
        rot = rot.unflatten(-1, (dim // 2, 2)).transpose(-1, -2).flatten(-2)
    rot = apply_rotary(rot, cos, sin)
    return rot if dim == x.shape[-1] else torch.cat((rot, x[..., dim:]), dim=-1)


def query_temperature(positions: torch.Tensor, period: int, strength: float, offset: int = 0,
                      log1p: bool = False) -> torch.Tensor:
    """fp32 ``[T]`` factors that scale each token's queries by its position, ``1 + strength * log(1 +
    floor((position + offset) / period))``: 1 over the first positions, then a step more every ``period``.
    Ministral 3's (transformers' ``get_llama_4_attn_scale``, offset 0) and Llama 4's temperature tuning of its
    NoPE layers (offset 1, ``log1p``: transformers takes ``torch.log1p`` there, which differs from ``log(1 + x)``
    in the last bit on some CPUs)."""
    steps = torch.floor((positions.float() + offset) / period)
    return (torch.log1p(steps) if log1p else torch.log(steps + 1)) * strength + 1.0


def position_query_scale(hf_config: PretrainedConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The factor by which a model scales each token's rotated query, as a function of the tokens' positions
    ``[T] -> [T]`` (fp32); None for models whose queries keep their scale. Ministral 3's is
    :func:`query_temperature`, from its rope's ``llama_4_scaling_beta``."""
    params = getattr(hf_config, 'rope_parameters', None) or {}
    beta = params.get('llama_4_scaling_beta')
    if not beta:
        return None
    return functools.partial(query_temperature, period=params['original_max_position_embeddings'], strength=beta)


def scale_queries(q: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Queries ``q [T, H, D]`` times their token's factor ``factors [T]`` (in ``q``'s dtype)."""
    return q * factors[:, None, None]


def step_seq_lens(ctx: StepContext) -> torch.Tensor:
    """The length of each token's sequence: all its tokens for prefill chunks, those up to the token for
    decode tokens."""
    lens = [] if ctx.prefill_seq_len is None else [
        torch.repeat_interleave(ctx.prefill_seq_len, ctx.prefill_q_len, output_size=ctx.num_prefill_tokens)]
    if ctx.decode_kv_lens is not None:
        lens.append(ctx.decode_kv_lens)
    return lens[0] if len(lens) == 1 else torch.cat(lens)


def mrope_axes(sections: list[int], num_freqs: int, interleaved: bool) -> torch.Tensor:
    """Which position axis (0 temporal, 1 height, 2 width) turns each rotary frequency: consecutive bands
    of ``sections`` frequencies (Qwen2-VL), or, ``interleaved`` (Qwen3-VL, Qwen3.5), height and width every third
    frequency from the second and third on (``sections[1]`` and ``sections[2]`` of them), the rest temporal."""
    if not interleaved:
        return torch.cat([torch.full((size,), index % 3) for index, size in enumerate(sections)])
    axes = torch.zeros(num_freqs, dtype=torch.long)
    axes[1:3 * sections[1]:3] = 1
    axes[2:3 * sections[2]:3] = 2
    return axes


def long_rope_after(hf_config: PretrainedConfig) -> int | None:
    """LongRoPE's ``original_max_position_embeddings``: sequences longer than it take the long factors
    (None for other rope types)."""
    params = getattr(hf_config, 'rope_parameters', None) or {}
    return params['original_max_position_embeddings'] if params.get('rope_type') == 'longrope' else None


class RotaryEmbedding(nn.Module):
    """Computes per-token ``cos, sin [T, rotary_dim]`` for the model's rope type.

    With ``mrope_section`` (Qwen-VL) positions are ``[3, T]`` (temporal, height, width) and each
    frequency turns with one of the three (see :func:`mrope_axes`). LongRoPE (Phi-3) turns the tokens of a sequence
    longer than ``original_max_position_embeddings`` by its long factors (every prefill chunk of a long
    prompt), the others by its short factors (and PhiMoE's ``long_mscale``/``short_mscale`` scale their cos and sin).
    A sequence that grows past that length while decoding is
    computed again, as transformers' ``generate`` does (see ``paging.scheduler.Scheduler``).
    """

    def __init__(self, hf_config: PretrainedConfig, head_dim: int, layer_type: str | None = None):
        super().__init__()
        params = getattr(hf_config, 'rope_parameters', None) or {}
        if layer_type is not None:  # one rope per layer type (Gemma 3: local and global bases)
            params = params[layer_type]
        per_type = {} if layer_type is None else {'layer_type': layer_type}
        rope_type = params.get('rope_type', 'default')
        if rope_type == 'dynamic' and params.get('alpha'):  # NTK-alpha (Hunyuan): the base stretched once, any length
            rope_type = 'ntk_alpha'
        self.long_inv_freq: torch.Tensor | None = None
        if rope_type in ('default', 'ntk_alpha'):
            base = params.get('rope_theta', getattr(hf_config, 'rope_theta', 10000.0))
            dim = rotary_dim(hf_config, head_dim, layer_type)
            if rope_type == 'ntk_alpha':
                base *= params['alpha']**(dim / (dim - 2))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != 'dynamic':
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device('cpu'), **per_type)
            if rope_type == 'longrope':
                self.original_max = long_rope_after(hf_config)
                self.long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device('cpu'),
                                                                       seq_len=self.original_max + 1, **per_type)
                # PhiMoE's own cos/sin factors of short and long sequences, in place of LongRoPE's one
                self.long_scaling = params.get('long_mscale', self.scaling)
                self.scaling = params.get('short_mscale', self.scaling)
        else:
            raise ValueError(f'rope type {rope_type!r} is not supported')
        # A plain attribute, not a buffer: casting the model to bf16 must not round the frequencies.
        self.inv_freq = inv_freq
        model_type = hf_config.model_type
        interleaved = model_type in INTERLEAVED_MROPE_SECTIONS
        default_sections = INTERLEAVED_MROPE_SECTIONS.get(model_type, MROPE_SECTIONS.get(model_type))
        sections = params.get('mrope_section', default_sections)
        self.mrope_select = None if sections is None else mrope_axes(sections, len(inv_freq), interleaved)

    def forward(self, ctx: StepContext, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = ctx.positions if ctx.rope_positions is None else ctx.rope_positions
        if self.inv_freq.device != positions.device:  # moved once, so that a CUDA graph captures no copy
            self.inv_freq = self.inv_freq.to(positions.device)
            self.mrope_select = None if self.mrope_select is None else self.mrope_select.to(positions.device)
            self.long_inv_freq = None if self.long_inv_freq is None else self.long_inv_freq.to(positions.device)
        scaling = self.scaling
        if positions.dim() == 2:
            freqs = positions.float()[self.mrope_select].T * self.inv_freq
        elif self.long_inv_freq is not None:
            long = (step_seq_lens(ctx) > self.original_max).unsqueeze(-1)
            freqs = positions.float().unsqueeze(-1) * torch.where(long, self.long_inv_freq, self.inv_freq)
            scaling = torch.where(long, self.long_scaling, self.scaling)
        else:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [len(positions), rotary_dim]`` of text ``positions [N]`` (M-RoPE: every axis at that position;
        no LongRoPE long factors): Qwen4-Exp's indexer turns each block key by its first token's position."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
