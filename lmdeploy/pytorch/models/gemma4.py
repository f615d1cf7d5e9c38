"""Gemma 4 (``Gemma4ForCausalLM``, and the hub's ``Gemma4ForConditionalGeneration`` read for its language model: its
vision and audio towers are skipped at load and the model takes text only).

Each layer is Gemma's (norms before and after attention and MLP, GeLU(tanh) MLP, sliding and full layers by
``layer_types``, each kind on its own rope table), with:

* norms that scale by their weight (not Gemma's ``1 + w``), q/k norms, values normed without a weight, and
  unscaled queries;
* full-attention layers of their own geometry (``per_layer_config``: ``global_head_dim`` features, and with
  ``attention_k_eq_v`` ``num_global_key_value_heads`` heads whose values are their keys before the k norm), turned by
  a proportional rope: only the first ``partial_rotary_factor`` of each half's frequencies turn;
* KV sharing: the last ``num_kv_shared_layers`` layers attend over the keys and values of the last earlier layer of
  their kind and hold no cache (as Gemma 3n's); with ``use_double_wide_mlp`` their MLP is twice as wide;
* per-layer inputs (``hidden_size_per_layer_input``): a table of features per layer and token, plus a projection of
  the embedding, gating a residual added after the MLP;
* with ``enable_moe_block`` a MoE block beside the dense MLP: routed (an unweighted norm, a learned scale, softmax
  top-k renormalized, times a per-expert scale) from the MLP's input before its norm, each branch with norms of its
  own, their sum normed once more;
* each layer's output times its ``layer_scalar``; final logits soft-capped.

No native decoder stack (per-layer inputs, KV sharing and the parallel MoE are none of its options); no tensor
parallelism."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.activation import gelu_tanh_and_mul
from lmdeploy.pytorch.kernels.moe import run_experts
from lmdeploy.pytorch.models.gemma import FULL_ATTENTION, SLIDING_ATTENTION
from lmdeploy.pytorch.models.gemma3n import (GemmaTextWithKVSharing, SharedKV, SharedKVAttention, UnscaledRMSNorm,
                                              kv_sources, scale_of)
from lmdeploy.pytorch.models.llama import KVCache, LlamaForCausalLM, LlamaMLP, WithoutNativeStack
from lmdeploy.pytorch.nn.embedding import VocabParallelEmbedding
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding
from lmdeploy.pytorch.step_context import StepContext


def check_config(hf_config) -> None:
    """Refuses what this module does not run, saying what."""
    if hf_config.hidden_activation != 'gelu_pytorch_tanh':
        raise ValueError(f'Gemma 4 with activation {hf_config.hidden_activation!r} is not supported')
    if hf_config.use_bidirectional_attention == 'all':
        raise ValueError('Gemma 4 with bidirectional attention over all tokens (an embedding model) is not supported')
    if hf_config.hidden_size_per_layer_input and hf_config.vocab_size_per_layer_input < hf_config.vocab_size:
        raise ValueError(f'Gemma 4 with a per-layer table of {hf_config.vocab_size_per_layer_input} tokens, fewer '
                         f'than its {hf_config.vocab_size}, is not supported')


class Gemma4Experts(nn.Module):
    """Every expert's GeLU(tanh) MLP, stacked as the checkpoints hold them: ``gate_up_proj [E, 2I, H]`` (gate rows,
    then up rows) and ``down_proj [E, H, I]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        def mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            return F.linear(gelu_tanh_and_mul(F.linear(rows, self.gate_up_proj[expert])), self.down_proj[expert])

        return run_experts(x, weights, ids, self.gate_up_proj.shape[0], mlp)


class Gemma4Router(nn.Module):
    """Routes each token from its unweighted norm times ``scale`` and ``hidden_size ** -0.5``: softmax (fp32) top-k,
    renormalized, each weight times its expert's ``per_expert_scale``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.top_k = hf.top_k_experts
        self.norm = UnscaledRMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.proj = Linear(cfg.hidden_size, hf.num_experts)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(hf.num_experts), requires_grad=False)
        self.root_size = cfg.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        weights, ids = torch.topk(torch.softmax(scores, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 layer (see the module's docstring)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, kv_source: int | None):
        super().__init__()
        hf = cfg.hf_config
        eps, hidden = hf.rms_norm_eps, cfg.hidden_size
        self.layer_type = hf.layer_types[layer_index]
        self.self_attn = SharedKVAttention(cfg, layer_index, kv_source)
        wide = 2 if hf.use_double_wide_mlp and kv_source is not None else 1
        self.mlp = LlamaMLP(cfg, hf.intermediate_size * wide, activation='gelu_tanh')
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.moe = bool(hf.enable_moe_block)
        if self.moe:
            self.router = Gemma4Router(cfg)
            self.experts = Gemma4Experts(hidden, hf.moe_intermediate_size, hf.num_experts)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.per_layer = bool(hf.hidden_size_per_layer_input)
        if self.per_layer:
            self.per_layer_input_gate = Linear(hidden, hf.hidden_size_per_layer_input)
            self.per_layer_projection = Linear(hf.hidden_size_per_layer_input, hidden)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output (plus the MoE block's) of the residual stream ``x``, before the last norm."""
        out = self.mlp(self.pre_feedforward_layernorm(x))
        if not self.moe:
            return out
        weights, ids = self.router(x)
        routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
        return self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext,
                shared: SharedKV) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), kv_cache, ctx, shared))
        x = x + self.post_feedforward_layernorm(self.feed_forward(x))
        if self.per_layer:
            gated = F.gelu(self.per_layer_input_gate(x), approximate='tanh') * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4ForCausalLM(GemmaTextWithKVSharing, WithoutNativeStack, LlamaForCausalLM):
    """Gemma 4's language model and LM head (see the module's docstring)."""

    tensor_parallel_refusal = ("its full-attention layers have KV heads of another number and width than its sliding "
                               "layers, a per-layer cache geometry that the ranks' split of the KV heads does not "
                               "cover")

    def __init__(self, cfg: ModelConfig):
        hf = cfg.hf_config
        check_config(hf)
        self.kv_sources = kv_sources(hf)
        super().__init__(cfg)
        per_layer = hf.hidden_size_per_layer_input
        self.per_layer_shape = (cfg.num_layers, per_layer)
        if per_layer:
            self.embed_tokens_per_layer = VocabParallelEmbedding(hf.vocab_size_per_layer_input,
                                                                 cfg.num_layers * per_layer)
            self.per_layer_model_projection = Linear(cfg.hidden_size, cfg.num_layers * per_layer)
            self.per_layer_projection_norm = RMSNorm(per_layer, hf.rms_norm_eps)
            self.per_layer_embed_scale = scale_of(per_layer**0.5, cfg.dtype)
        self.ropes = nn.ModuleDict({kind: RotaryEmbedding(hf, cfg.kv_geometry(hf.layer_types.index(kind))[1], kind)
                                    for kind in (FULL_ATTENTION, SLIDING_ATTENTION) if kind in hf.layer_types})
        self.rotary = self.ropes[FULL_ATTENTION]
        self.final_logit_softcap = hf.final_logit_softcapping
        self.embed_scale = scale_of(cfg.hidden_size**0.5, cfg.dtype)
        self.requires_grad_(False)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return Gemma4DecoderLayer(cfg, layer_index, self.kv_sources[layer_index])

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[T, layers, hidden_size_per_layer_input]``: each layer's own embedding of the token and its share of the
        projected embedding, normed, summed and scaled by ``1 / sqrt(2)``."""
        table = self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale
        projected = self.per_layer_model_projection(embeds) * self.cfg.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(-1, *self.per_layer_shape))
        return (projected + table.view(-1, *self.per_layer_shape)) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        tables = {kind: rope(ctx, self.cfg.dtype) for kind, rope in self.ropes.items()}
        x = self.embed(input_ids, ctx)
        per_layer = self.per_layer_inputs(input_ids, x) if self.cfg.hf_config.hidden_size_per_layer_input else None
        shared: SharedKV = {}
        for index, layer in enumerate(self.layers):
            ctx.cos, ctx.sin = tables[layer.layer_type]
            source = self.kv_sources[index]
            x = layer(x, None if per_layer is None else per_layer[:, index], kv_caches[index if source is None
                                                                                      else source], ctx, shared)
        return self.norm(x)
