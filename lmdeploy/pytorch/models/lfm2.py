"""Liquid AI's LFM2 (``Lfm2ForCausalLM``) and LFM2-MoE (``Lfm2MoeForCausalLM``): hybrid decoders whose
``layer_types`` interleave gated short convolutions (``conv``: a recurrent state per sequence, see
``paging/state_pool.py``) with attention over the paged KV cache (per-head q/k RMSNorms before the rotary). A
short convolution projects the input to ``B, C, x``, runs a causal depthwise convolution of ``conv_L_cache`` taps
(no activation) over ``B * x`` and multiplies it by ``C``; its state is the last ``conv_L_cache - 1`` values of
``B * x``. The MLP is SwiGLU; LFM2-MoE's layers past ``num_dense_layers`` are mixtures of experts routed by sigmoid
scores plus an expert bias.

LFM3 (``Lfm3ForCausalLM``) keeps LFM2's short convolutions and adds sliding-window attention layers
(``sliding_attention`` in ``layer_types``, each attention type turning by its own rope: ``rope_parameters`` per layer
type, the full layers' ``proportional`` one rotating only the first ``partial_rotary_factor`` of each half-head's
frequencies), a sigmoid gate per head on the attention output (``g_proj``, where ``use_attention_gate``), RMSNorms on
the mixer's and the MLP's outputs before the residual adds them (``post_operator_norm``, ``post_ffn_norm``, where
``use_sandwich_norm``) and a dense SwiGLU of ``intermediate_size``. Every step runs the layers' own forward (no
native decoder stack)."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import grouped_topk
from lmdeploy.pytorch.kernels.gated_delta import causal_conv1d
from lmdeploy.pytorch.models.deepseek_v3 import TopKRouter
from lmdeploy.pytorch.models.gemma import LAYER_TYPES
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaMLP, WithoutNativeStack, layer_window
from lmdeploy.pytorch.models.moe import MoEForCausalLM, split_stacked_experts
from lmdeploy.pytorch.models.qwen3_next import CausalConv1d
from lmdeploy.pytorch.nn.linear import ColumnLinear, Linear
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

CONV = 'conv'
ROUTER_RENORMALIZE_EPS = 1e-6  # transformers' Lfm2MoeTopKRouter divides by the weights' sum plus this
# checkpoint name pattern -> the engine's
RENAMED = [(re.compile(r'\.feed_forward\.'), '.mlp.'),
           (re.compile(r'\.mlp\.w1\.'), '.mlp.gate_proj.'),
           (re.compile(r'\.mlp\.w3\.'), '.mlp.up_proj.'),
           (re.compile(r'\.mlp\.w2\.'), '.mlp.down_proj.'),
           (re.compile(r'\.mlp\.expert_bias$'), '.mlp.gate.e_score_correction_bias'),
           (re.compile(r'\.self_attn\.out_proj\.'), '.self_attn.o_proj.'),
           (re.compile(r'\.self_attn\.gate_proj\.'), '.self_attn.g_proj.'),  # LFM3's head gate, saved so
           (re.compile(r'\.self_attn\.q_layernorm\.'), '.self_attn.q_norm.'),
           (re.compile(r'\.self_attn\.k_layernorm\.'), '.self_attn.k_norm.'),
           (re.compile(r'\.operator_norm\.'), '.input_layernorm.'),
           (re.compile(r'\.ffn_norm\.'), '.post_attention_layernorm.'),
           (re.compile(r'^(model\.)?embedding_norm\.'), r'\1norm.')]


def engine_name(name: str) -> str:
    """The engine's name of an LFM2 checkpoint tensor."""
    for pattern, new in RENAMED:
        name = pattern.sub(new, name)
    return name


def dense_intermediate_size(hf: PretrainedConfig) -> int:
    """LFM2's MLP width: ``intermediate_size``, or with ``block_auto_adjust_ff_dim`` two thirds of it, times
    ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of`` (as transformers' ``Lfm2MLP``)."""
    size = hf.intermediate_size
    if not getattr(hf, 'block_auto_adjust_ff_dim', False):
        return size
    size = int(2 * size / 3)
    if hf.block_ffn_dim_multiplier is not None:
        size = int(hf.block_ffn_dim_multiplier * size)
        size = hf.block_multiple_of * ((size + hf.block_multiple_of - 1) // hf.block_multiple_of)
    return size


class ShortConv(nn.Module):
    """LFM2's gated short convolution over a convolution state per sequence, ``conv [slots, hidden, L - 1]`` (a
    row per sequence: ``ctx.state_prefill``, ``ctx.state_decode_slots``): ``out_proj(C * conv(B * x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.hidden_size, self.kernel = cfg.hidden_size, hf.conv_L_cache
        bias = bool(hf.conv_bias)
        self.in_proj = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=bias)
        self.conv = CausalConv1d(cfg.hidden_size, self.kernel, bias=bias)
        self.out_proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=bias)
        self.dtype = cfg.dtype

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One slot's convolution state."""
        return [((self.hidden_size, self.kernel - 1), self.dtype)]

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor], ctx: StepContext) -> torch.Tensor:
        (conv_states,) = state
        B, C, x = self.in_proj(hidden).chunk(3, dim=-1)
        gated = B * x
        weight, bias = self.conv.weight.squeeze(1), self.conv.bias
        out = torch.empty_like(gated)
        for slot, start, length, fresh in ctx.state_prefill:
            rows = slice(start, start + length)
            # a new (or recomputed) sequence starts from zeros: the slot's old content is not read
            conv_state = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
            mixed, conv_states[slot] = (t[0] for t in causal_conv1d(gated[rows].T[None], conv_state[None], weight,
                                                                   bias, silu=False))
            out[rows] = mixed.T
        num_prefill = ctx.num_prefill_tokens
        if num_prefill < hidden.shape[0]:
            slots = ctx.state_decode_slots
            mixed, conv_states[slots] = causal_conv1d(gated[num_prefill:, :, None], conv_states[slots], weight, bias,
                                                      silu=False)
            out[num_prefill:] = mixed.squeeze(-1)
        return self.out_proj(C * out)


class Lfm2MoE(nn.Module):
    """LFM2-MoE's sparse block: ``sigmoid`` router scores; the top-k experts chosen by score plus
    ``expert_bias`` (where ``use_expert_bias``), weighted by their unbiased scores, renormalized where
    ``norm_topk_prob``, times ``routed_scaling_factor``; no shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.top_k, self.renormalize = hf.num_experts_per_tok, bool(hf.norm_topk_prob)
        self.scaling, self.use_expert_bias = float(hf.routed_scaling_factor), bool(hf.use_expert_bias)
        self.gate = TopKRouter(cfg.hidden_size, hf.num_experts, correction_bias=self.use_expert_bias)
        self.experts = FusedExperts(cfg.hidden_size, hf.moe_intermediate_size, hf.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        bias = self.gate.e_score_correction_bias if self.use_expert_bias else logits.new_zeros(logits.shape[-1])
        weights, ids = grouped_topk(logits, bias, self.top_k, 1, 1, self.renormalize, self.scaling,
                                    ROUTER_RENORMALIZE_EPS)
        return self.experts(x, weights, ids)


class HeadGatedAttention(LlamaAttention):
    """LFM3's attention: LFM2's (q/k RMSNorms per head before the rotary) whose output, before ``o_proj``, is scaled
    per head by ``sigmoid(g_proj(x))`` (``g_proj``: one output per query head)."""

    def __init__(self, cfg: ModelConfig, sliding_window: int | None):
        super().__init__(cfg, sliding_window=sliding_window, qk_norm=True, qk_norm_eps=cfg.hf_config.norm_eps,
                         qkv_bias=False, o_bias=False)
        self.g_proj = ColumnLinear(cfg.hidden_size, cfg.num_heads)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        out = self.attend(x, kv_cache, ctx)
        gate = torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
        return self.o_proj((out.view(-1, self.num_heads, self.head_dim) * gate).flatten(1))


class Lfm2DecoderLayer(nn.Module):
    """``x + mixer(operator_norm(x))``, then ``+ mlp(ffn_norm(x))``; the mixer is a :class:`ShortConv` (``conv``)
    or attention with q/k RMSNorms (``self_attn``: over the layer's window, gated per head where the config has
    ``use_attention_gate``). With ``use_sandwich_norm`` (LFM3) the mixer's and the MLP's outputs are RMS-normed
    before the residual adds them. Like Llama's layers it hands the residual sum on."""

    def __init__(self, cfg: ModelConfig, layer_index: int, mlp: nn.Module):
        super().__init__()
        hf = cfg.hf_config
        self.layer_type = hf.layer_types[layer_index]
        self.is_conv = self.layer_type == CONV
        if self.is_conv:
            self.conv = ShortConv(cfg)
        elif getattr(hf, 'use_attention_gate', False):
            self.self_attn = HeadGatedAttention(cfg, layer_window(hf, layer_index))
        else:
            self.self_attn = LlamaAttention(cfg, qk_norm=True, qk_norm_eps=hf.norm_eps, qkv_bias=False, o_bias=False,
                                            sliding_window=layer_window(hf, layer_index))
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, hf.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, hf.norm_eps)
        sandwich = getattr(hf, 'use_sandwich_norm', False)
        self.post_operator_norm = RMSNorm(cfg.hidden_size, hf.norm_eps) if sandwich else None
        self.post_ffn_norm = RMSNorm(cfg.hidden_size, hf.norm_eps) if sandwich else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cache: KVCache, ctx: StepContext):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.conv(x, cache, ctx) if self.is_conv else self.self_attn(x, cache, ctx)
        if self.post_operator_norm is not None:
            x = self.post_operator_norm(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return (x if self.post_ffn_norm is None else self.post_ffn_norm(x)), residual


class Lfm2ForCausalLM(WithoutNativeStack, MoEForCausalLM):
    """LFM2, LFM2-MoE and LFM3 decoders (see the module's docstring); the final norm is the checkpoints'
    ``embedding_norm``; each attention layer turns by its layer type's rope (``ropes``; LFM2's one for all)."""

    tensor_parallel_refusal = 'its short-convolution layers are not sharded for tensor parallelism'
    recurrent_chunk = 0  # the convolution does not round by chunks: prefill chunks may end anywhere

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        attention_types = [kind for kind in LAYER_TYPES if kind in hf.layer_types]
        per_type = bool(set(LAYER_TYPES) & set(getattr(hf, 'rope_parameters', None) or {}))  # LFM3's: keyed by type
        self.ropes = {kind: RotaryEmbedding(hf, cfg.head_dim, kind) if per_type else self.rotary
                      for kind in attention_types}

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        tables = {kind: rope(ctx, self.cfg.dtype) for kind, rope in self.ropes.items()}
        x = self.embed(input_ids, ctx)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            if not layer.is_conv:
                ctx.cos, ctx.sin = tables[layer.layer_type]
            x, residual = layer(x, residual, kv_cache, ctx)
        x, _ = self.norm(x, residual)
        return x

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return Lfm2DecoderLayer(cfg, layer_index, self.make_mlp(cfg, layer_index))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        if hf.model_type != 'lfm2_moe':  # LFM2's (its width adjusted) and LFM3's
            return LlamaMLP(cfg, dense_intermediate_size(hf))
        return LlamaMLP(cfg, hf.intermediate_size) if layer_index < hf.num_dense_layers else Lfm2MoE(cfg)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.hf_config.norm_eps)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Renames the checkpoint's tensors to the engine's (:func:`engine_name`) and splits stacked experts
        (transformers 5's ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
        renamed = ((engine_name(name), tensor) for name, tensor in weights)
        return split_stacked_experts(super().split_fused(renamed), self.cfg.hidden_size)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Per layer, one sequence's convolution state (short-convolution layers) or None (attention layers)."""
        return [layer.conv.state_shapes() if layer.is_conv else None for layer in self.layers]
