"""Gemma 3n (``Gemma3nForCausalLM``, and the hub's ``Gemma3nForConditionalGeneration`` read for its language model:
the vision and audio towers are skipped at load and the model takes text only).

Each layer is Gemma's (norms before and after attention and MLP, GeLU(tanh) MLP, local and global layers by
``layer_types``, each kind on its own rope table) inside three additions:

* AltUp: the hidden state is ``altup_num_inputs`` streams; a layer runs on the ``altup_active_idx`` stream of its
  prediction (a per-token mix of the streams, routed by that stream) and its output corrects every stream;
* LAuReL: a low-rank residual (``laurel_rank``) beside attention, averaged in by ``1 / sqrt(2)``;
* per-layer inputs: a table of ``hidden_size_per_layer_input`` features per layer and token, plus a projection of
  the embedding, gated by the active stream and added to the other streams.

Norms scale by their weight (not Gemma's ``1 + w``); values get a norm without weight; queries are not scaled.
The first layers' MLP (``activation_sparsity_pattern``) keeps only the gate's values above a Gaussian quantile of
each token's gate. The last ``num_kv_shared_layers`` layers compute no keys nor values: each attends over those of
the last earlier layer of its kind, in that layer's KV cache, and holds no cache of its own. No native decoder stack
(its layers have none of these parts); no tensor parallelism."""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.activation import gelu_tanh_and_mul
from lmdeploy.pytorch.models.gemma import FULL_ATTENTION, SLIDING_ATTENTION, soft_capped
from lmdeploy.pytorch.models.llama import (KVCache, LlamaForCausalLM, LlamaMLP, WeightTarget, WithoutNativeStack,
                                           layer_window)
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.nn.embedding import VocabParallelEmbedding
from lmdeploy.pytorch.nn.linear import Linear, MergedLinear, RowLinear
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding, apply_rope
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# the hub's Gemma3nForConditionalGeneration keeps its language model here, beside its towers (not loaded)
LANGUAGE_MODEL_PREFIX = 'model.language_model.'
TOWER_PREFIXES = ('model.vision_tower.', 'model.audio_tower.', 'model.embed_vision.', 'model.embed_audio.')
# the keys and values of the step's tokens, per layer kind, from the last layer of that kind that computes them
SharedKV = dict[str, tuple[torch.Tensor, torch.Tensor]]


def kv_sources(hf_config) -> list[int | None]:
    """Per layer, the earlier layer whose KV cache it reads (the last ``num_kv_shared_layers`` layers: the last layer
    of the same kind before them), None for a layer with keys and values of its own."""
    kinds = hf_config.layer_types
    first_shared = len(kinds) - (hf_config.num_kv_shared_layers or 0)
    sources: list[int | None] = [None] * first_shared
    for kind in kinds[first_shared:]:
        owners = [i for i in range(first_shared) if kinds[i] == kind]
        if not owners:
            raise ValueError(f'Gemma 3n: a KV-sharing {kind} layer follows no {kind} layer to share with')
        sources.append(owners[-1])
    return sources


def scale_of(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as transformers' fp32 buffers are cast before they scale."""
    return torch.tensor(value, dtype=dtype).item()


def rms_magnitude(x: torch.Tensor) -> torch.Tensor:
    """The root mean square of each row of ``x`` ``[..., 1]``."""
    return torch.mean(x**2, dim=-1, keepdim=True)**0.5


def matched_magnitude(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``x`` rescaled to rows of root mean square ``target`` (its own floored at ``sqrt(1e-5)``)."""
    return x * target / torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))


class UnscaledRMSNorm(nn.Module):
    """RMSNorm without a weight (Gemma 3n's value norm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.register_buffer('ones', torch.ones(size), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rms_norm(x, self.ones.shape, self.ones.to(x.dtype), self.eps)


class SharedKVAttention(nn.Module):
    """Gemma 3n's and Gemma 4's attention: the layer's KV geometry (``ModelConfig.kv_geometry``), q/k norms and an
    unscaled v norm before the rotation, a query scale of 1, biases per ``attention_bias``; with
    ``attention_k_eq_v`` (Gemma 4) a full layer's values are its keys before their norm; a KV-sharing layer
    (``kv_source``) projects queries only and attends over its source layer's keys and values."""

    def __init__(self, cfg: ModelConfig, layer_index: int, kv_source: int | None):
        super().__init__()
        hf = cfg.hf_config
        self.num_kv_heads, self.head_dim = cfg.kv_geometry(layer_index)
        self.num_heads, self.kind, self.kv_source = cfg.num_heads, hf.layer_types[layer_index], kv_source
        self.keys_are_values = bool(getattr(hf, 'attention_k_eq_v', False)) and self.kind != SLIDING_ATTENTION
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(hf, 'attention_bias', False))
        if kv_source is not None:
            sizes = [q_size]
        else:
            sizes = [q_size, kv_size] if self.keys_are_values else [q_size, kv_size, kv_size]
        self.qkv_proj = MergedLinear(cfg.hidden_size, sizes, bias)
        if kv_source is None:
            self.k_norm = RMSNorm(self.head_dim, hf.rms_norm_eps)
            self.v_norm = UnscaledRMSNorm(self.head_dim, hf.rms_norm_eps)
        self.q_norm = RMSNorm(self.head_dim, hf.rms_norm_eps)
        self.o_proj = RowLinear(q_size, cfg.hidden_size, bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0, cfg.quant_policy,
                                   sliding_window=layer_window(hf, layer_index), fills_cache=kv_source is None)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext, shared: SharedKV) -> torch.Tensor:
        projected = self.qkv_proj(x)
        q_size = self.num_heads * self.head_dim
        q = self.q_norm(projected[:, :q_size].view(-1, self.num_heads, self.head_dim))
        if self.kv_source is not None:
            k, v = shared[self.kind]
            return self.o_proj(self.attn(apply_rope(q, ctx.cos, ctx.sin), k, v, kv_cache, ctx))
        kv = projected[:, q_size:].view(-1, (1 if self.keys_are_values else 2) * self.num_kv_heads, self.head_dim)
        raw_k, raw_v = kv[:, :self.num_kv_heads], kv[:, -self.num_kv_heads:]
        k, v = self.k_norm(raw_k.contiguous()), self.v_norm(raw_v.contiguous())
        qk = apply_rope(torch.cat((q, k), dim=1), ctx.cos, ctx.sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        shared[self.kind] = k, v
        return self.o_proj(self.attn(q, k, v, kv_cache, ctx))


class Gemma3nMLP(LlamaMLP):
    """Gemma's GeLU(tanh) MLP of the layer's width; with a ``sparsity`` each token's gate keeps only its excess over
    ``mean + std * Phi^-1(sparsity)`` of its values (0 below that)."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        hf = cfg.hf_config
        super().__init__(cfg, hf.intermediate_size[layer_index], activation='gelu_tanh')
        sparsity = hf.activation_sparsity_pattern[layer_index]
        self.std_multiplier = (torch.distributions.Normal(0, 1).icdf(torch.tensor(sparsity)).item()
                               if sparsity > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.std_multiplier is None:
            return super().forward(x)
        gate_up = self.gate_up_proj.kernel(x, None)
        gate, up = gate_up.chunk(2, dim=-1)
        multiplier = scale_of(self.std_multiplier, gate.dtype)
        cutoff = gate.mean(-1, keepdim=True) + gate.std(-1, keepdim=True, unbiased=False) * multiplier
        return self.down_proj(gelu_tanh_and_mul(torch.cat((F.relu(gate - cutoff), up), dim=-1)))


class AltUp(nn.Module):
    """AltUp's predict and correct steps over the streams ``[n, T, H]``, routed by one stream's norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        n = hf.altup_num_inputs
        self.n, self.active = n, hf.altup_active_idx
        self.correct_output_scale = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=False)
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(cfg.hidden_size, n, bias=False)
        self.router_norm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.router_input_scale = scale_of(cfg.hidden_size**-1.0, cfg.dtype)

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """Each stream plus a per-token mix of all of them."""
        coefs = self.prediction_coefs(self.modalities(streams[self.active]))
        coefs = coefs.view(-1, self.n, self.n).transpose(1, 2)  # [T, n, n]
        return (torch.matmul(streams.permute(1, 2, 0), coefs).permute(2, 0, 1) + streams).contiguous()

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Each prediction moved by the layer's innovation on the active one, weighted per stream and token."""
        coefs = (self.correction_coefs(self.modalities(activated)) + 1.0).T.unsqueeze(-1)  # [n, T, 1]
        return ((activated - predictions[self.active]) * coefs + predictions).contiguous()


class Laurel(nn.Module):
    """LAuReL: ``x + norm(right(left(x)))``, a residual through ``laurel_rank`` features."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.linear_left = Linear(cfg.hidden_size, hf.laurel_rank)
        self.linear_right = Linear(hf.laurel_rank, cfg.hidden_size)
        self.post_laurel_norm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class Gemma3nDecoderLayer(nn.Module):
    """One Gemma 3n layer over the AltUp streams (see the module's docstring)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, kv_source: int | None):
        super().__init__()
        hf = cfg.hf_config
        eps, hidden, per_layer = hf.rms_norm_eps, cfg.hidden_size, hf.hidden_size_per_layer_input
        if hf.hidden_activation != 'gelu_pytorch_tanh':
            raise ValueError(f'Gemma 3n with activation {hf.hidden_activation!r} is not supported')
        self.layer_type = hf.layer_types[layer_index]
        self.correct_scale = bool(hf.altup_correct_scale)
        self.self_attn = SharedKVAttention(cfg, layer_index, kv_source)
        self.mlp = Gemma3nMLP(cfg, layer_index)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.altup = AltUp(cfg)
        self.laurel = Laurel(cfg)
        self.per_layer_input_gate = Linear(hidden, per_layer)
        self.per_layer_projection = Linear(per_layer, hidden)
        self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(self, streams: torch.Tensor, per_layer_input: torch.Tensor, kv_cache: KVCache, ctx: StepContext,
                shared: SharedKV) -> torch.Tensor:
        predictions = self.altup.predict(streams)
        active = predictions[self.altup.active]
        normed = self.input_layernorm(active)
        laurel_out = self.laurel(normed)
        attn = self.post_attention_layernorm(self.self_attn(normed, kv_cache, ctx, shared))
        attn_laurel = (active + attn + laurel_out) / math.sqrt(2)
        ffw = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(attn_laurel)))
        corrected = self.altup.correct(predictions, attn_laurel + ffw)
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        gated = F.gelu(self.per_layer_input_gate(first), approximate='tanh') * per_layer_input
        corrected[1:] += self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return corrected


class GemmaTextWithKVSharing:
    """The parts Gemma 3n's and Gemma 4's text models share (before ``LlamaForCausalLM`` in their bases): soft-capped
    logits, no cache for the layers that read another's (``kv_sources``), and a multimodal checkpoint read for its
    language model."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return soft_capped(self.lm_head(hidden), self.final_logit_softcap)

    def recurrent_state_shapes(self) -> list[list | None]:
        """Per layer: None (a KV cache of its own), or nothing for the KV-sharing layers."""
        return [None if source is None else [] for source in self.kv_sources]

    def weight_target(self, name: str) -> WeightTarget | None:
        """As Llama's; the keys and values a checkpoint may hold for the KV-sharing layers are not used."""
        parts = name.split('.')
        if (len(parts) > 4 and parts[0] == 'layers' and parts[3] in ('k_proj', 'v_proj', 'k_norm', 'v_norm')
                and self.kv_sources[int(parts[1])] is not None):
            return None
        return super().weight_target(name)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """The language model's tensors (a multimodal checkpoint's under ``model.language_model.``,
        its towers' skipped)."""
        language_model = ((name.replace(LANGUAGE_MODEL_PREFIX, 'model.', 1), tensor) for name, tensor in weights
                          if not name.startswith(TOWER_PREFIXES))
        return super().split_fused(language_model)


class Gemma3nForCausalLM(GemmaTextWithKVSharing, WithoutNativeStack, LlamaForCausalLM):
    """Gemma 3n's language model and LM head (see the module's docstring)."""

    tensor_parallel_refusal = ("its activation-sparsity cutoff takes each token's statistics over the whole MLP "
                               "width, which tensor parallelism splits")

    def __init__(self, cfg: ModelConfig):
        self.kv_sources = kv_sources(cfg.hf_config)
        super().__init__(cfg)
        hf = cfg.hf_config
        num_layers, per_layer = cfg.num_layers, hf.hidden_size_per_layer_input
        self.per_layer_shape = (num_layers, per_layer)
        self.per_layer_vocab = hf.vocab_size_per_layer_input
        self.embed_tokens_per_layer = VocabParallelEmbedding(self.per_layer_vocab, num_layers * per_layer)
        self.per_layer_model_projection = Linear(cfg.hidden_size, num_layers * per_layer)
        self.per_layer_projection_norm = RMSNorm(per_layer, hf.rms_norm_eps)
        self.altup_projections = nn.ModuleList(
            Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(1, hf.altup_num_inputs))
        self.altup_unembed_projections = nn.ModuleList(
            Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(1, hf.altup_num_inputs))
        self.ropes = nn.ModuleDict({kind: RotaryEmbedding(hf, cfg.head_dim, kind)
                                    for kind in (FULL_ATTENTION, SLIDING_ATTENTION)})
        self.rotary = self.ropes[FULL_ATTENTION]
        self.final_logit_softcap = hf.final_logit_softcapping
        self.embed_scale = scale_of(cfg.hidden_size**0.5, cfg.dtype)
        self.per_layer_embed_scale = scale_of(per_layer**0.5, cfg.dtype)
        self.per_layer_projection_scale = scale_of(cfg.hidden_size**-0.5, cfg.dtype)
        self.per_layer_input_scale = scale_of(0.5**0.5, cfg.dtype)
        self.requires_grad_(False)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return Gemma3nDecoderLayer(cfg, layer_index, self.kv_sources[layer_index])

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[T, layers, hidden_size_per_layer_input]``: each layer's own embedding of the token (row 0 for tokens
        past the per-layer table) and its share of the projected embedding, normed, summed and scaled."""
        in_table = (input_ids >= 0) & (input_ids < self.per_layer_vocab)
        table = self.embed_tokens_per_layer(torch.where(in_table, input_ids, 0)) * self.per_layer_embed_scale
        projected = self.per_layer_model_projection(embeds) * self.per_layer_projection_scale
        projected = self.per_layer_projection_norm(projected.view(-1, *self.per_layer_shape))
        return (projected + table.view(-1, *self.per_layer_shape)) * self.per_layer_input_scale

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        tables = {kind: rope(ctx, self.cfg.dtype) for kind, rope in self.ropes.items()}
        x = self.embed(input_ids, ctx)
        per_layer = self.per_layer_inputs(input_ids, x)
        target = rms_magnitude(x)
        streams = torch.stack([x] + [matched_magnitude(proj(x), target) for proj in self.altup_projections])
        shared: SharedKV = {}
        for index, layer in enumerate(self.layers):
            ctx.cos, ctx.sin = tables[layer.layer_type]
            source = self.kv_sources[index]
            streams = layer(streams, per_layer[:, index], kv_caches[index if source is None else source], ctx, shared)
        target = rms_magnitude(streams[0])
        merged = [streams[0]] + [matched_magnitude(proj(stream), target)
                                 for proj, stream in zip(self.altup_unembed_projections, streams[1:])]
        return self.norm(torch.stack(merged).mean(dim=0))
