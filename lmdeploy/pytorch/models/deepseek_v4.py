"""DeepSeek-V4 (``DeepseekV4ForCausalLM``: V4-Flash, V4-Pro): ``hc_mult`` residual streams that each layer mixes
(manifold-constrained hyper-connections: a Sinkhorn-normalized mixing matrix, weights that collapse the streams into
the block's input and spread its output back), the attention of ``deepseek_v4_attention.py`` (sliding window, CSA
or HCA per ``layer_types``) and a mixture of experts per layer: its experts chosen by a frozen token table
(``hash_moe``) or by top-k of the scores plus a correction bias (``moe``), weighted by ``sqrt(softplus)`` scores
renormalized, SwiGLU clamped at ``swiglu_limit`` in the routed and the shared experts. Checkpoint names are the
hub's (``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``hc_attn_fn``...), as transformers saves them too."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.compressed_attention import PagedRows
from lmdeploy.pytorch.models.deepseek_v4_attention import (Fp32RMSNorm, V4Attention, V4Rotary, V4Step,
                                                           unweighted_rms_norm)
from lmdeploy.pytorch.models.llama import KVCache, LlamaForCausalLM, WeightTarget, WithoutNativeStack
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import Fp32Router
from lmdeploy.pytorch.nn.quant import Layout, new_parameter
from lmdeploy.pytorch.step_context import StepContext

# the hub's names of the tensors outside the layers' modules -> this model's
RENAMES = ((re.compile(r'^embed\.'), 'embed_tokens.'), (re.compile(r'^head\.'), 'lm_head.'),
           (re.compile(r'^hc_head_(fn|base|scale)$'), r'hc_head.hc_\1'),
           (re.compile(r'\.hc_(attn|ffn)_(fn|base|scale)$'), r'.hc_\1.\2'))
EXPERT = re.compile(r'(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight')
LAYER_INDEX = re.compile(r'layers\.(\d+)\.')


def fp32_parameter(*shape: int) -> nn.Parameter:
    return new_parameter(shape, Layout(None, None), torch.float32)


class HyperConnection(nn.Module):
    """From ``streams [T, n, hidden]``: ``pre`` weights that collapse them into the block's input, ``post`` weights
    that spread its output back, and ``comb [T, n, n]`` (Sinkhorn-normalized) that mixes them; all in fp32."""

    def __init__(self, hidden_size: int, hc: int, iterations: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iterations, self.eps, self.norm_eps = hc, iterations, eps, norm_eps
        self.fn = fp32_parameter((2 + hc) * hc, hc * hidden_size)
        self.base = fp32_parameter((2 + hc) * hc)
        self.scale = fp32_parameter(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc = self.hc
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * comb_scale + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class HyperHead(nn.Module):
    """The streams' final collapse, by sigmoid weights of their normed features."""

    def __init__(self, hidden_size: int, hc: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = fp32_parameter(hc, hc * hidden_size)
        self.hc_base = fp32_parameter(hc)
        self.hc_scale = fp32_parameter(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class V4Router(Fp32Router):
    """The fp32 router with the layer's choice of experts: ``tid2eid [vocab, k]`` of the token (``hash_moe``), or
    the top-k of the scores plus ``bias`` (``moe``); weights are the chosen scores renormalized, times the scaling."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        hf = cfg.hf_config
        super().__init__(cfg.hidden_size, hf.n_routed_experts)
        self.top_k, self.scaling, self.score = hf.num_experts_per_tok, hf.routed_scaling_factor, ACT2FN[hf.scoring_func]
        self.hashed = hashed
        if hashed:
            self.tid2eid = new_parameter((hf.vocab_size, self.top_k), Layout(None, None), torch.int64)
        else:
            self.bias = fp32_parameter(hf.n_routed_experts)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] fp32, experts [T, k])``."""
        scores = self.score(self(x))
        if self.hashed:
            ids = self.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class V4Experts(nn.Module):
    """The routed experts' ``w1`` (gate), ``w3`` (up) ``[E, I, hidden]`` and ``w2`` (down) ``[E, hidden, I]``, run
    expert by expert in torch."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        experts, size, hidden = hf.n_routed_experts, hf.moe_intermediate_size, cfg.hidden_size
        self.limit = hf.swiglu_limit
        self.w1 = new_parameter((experts, size, hidden), Layout(None, None))
        self.w3 = new_parameter((experts, size, hidden), Layout(None, None))
        self.w2 = new_parameter((experts, hidden, size), Layout(None, None))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            h = x[tokens]
            h = clamped_swiglu(F.linear(h, self.w1[expert]), F.linear(h, self.w3[expert]), self.limit)
            # accumulating index_put_, not index_add_: the same sums, without a parallel region per call (10 ms
            # each on two busy cores)
            out.index_put_((tokens,), (F.linear(h, self.w2[expert]) * weights[tokens, slots, None]).to(out.dtype),
                           accumulate=True)
        return out

    def weight_shards(self) -> dict[str, list[str]]:
        return {name: [f'expert {e}' for e in range(self.w1.shape[0])] for name in ('w1', 'w2', 'w3')}


class SharedExperts(nn.Module):
    """The shared experts: one MLP with the routed experts' clamped SwiGLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        size = hf.moe_intermediate_size * hf.n_shared_experts
        self.limit = hf.swiglu_limit
        self.w1, self.w3 = Linear(cfg.hidden_size, size), Linear(cfg.hidden_size, size)
        self.w2 = Linear(size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V4MoE(nn.Module):
    """The routed experts (hash- or top-k-routed, see :class:`V4Router`) plus the shared experts."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.gate = V4Router(cfg, hashed)
        self.experts = V4Experts(cfg)
        self.shared_experts = SharedExperts(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate.route(x, input_ids)) + self.shared_experts(x)


class V4Block(nn.Module):
    """A decoder layer over the streams: each of attention and MoE reads their collapse (normed) and its output is
    spread over the mixed streams."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        eps = hf.rms_norm_eps
        self.attn = V4Attention(cfg, hf.layer_types[layer_index])
        self.ffn = V4MoE(cfg, hf.mlp_layer_types[layer_index] == 'hash_moe')
        self.attn_norm, self.ffn_norm = Fp32RMSNorm(cfg.hidden_size, eps), Fp32RMSNorm(cfg.hidden_size, eps)
        self.hc_attn, self.hc_ffn = (HyperConnection(cfg.hidden_size, hf.hc_mult, hf.hc_sinkhorn_iters, hf.hc_eps, eps)
                                     for _ in range(2))

    def forward(self, streams: torch.Tensor, cache: torch.Tensor, step: V4Step, rotary: V4Rotary) -> torch.Tensor:
        post, comb, collapsed = self.hc_attn(streams)
        streams = self.spread(self.attn(self.attn_norm(collapsed), cache, step, rotary), post, comb, streams)
        post, comb, collapsed = self.hc_ffn(streams)
        return self.spread(self.ffn(self.ffn_norm(collapsed), step.input_ids), post, comb, streams)

    @staticmethod
    def spread(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                               streams)


class DeepseekV4ForCausalLM(WithoutNativeStack, LlamaForCausalLM):
    """DeepSeek-V4 (see the module's docstring); its cache is one row per token and layer (``ModelConfig.kv_latent_dim``,
    see ``kernels/compressed_attention.py``)."""

    stacked_params = {}
    decode_graphs = False  # the compressed attention sizes its gathers on the host
    tensor_parallel_refusal = ('its attention (one key-value head, the grouped output projection) and its '
                               'compressors are not sharded for tensor parallelism')

    def __init__(self, cfg: ModelConfig):
        if cfg.quant_policy:
            raise ValueError('DeepSeek-V4 keeps its compressed caches in the model dtype: use quant_policy=0')
        super().__init__(cfg)
        hf = cfg.hf_config
        self.hc = hf.hc_mult
        del self.rotary  # Llama's; V4 turns pairs, two bases
        self.angles = V4Rotary(hf)
        self.hc_head = HyperHead(cfg.hidden_size, hf.hc_mult, hf.hc_eps, hf.rms_norm_eps)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return V4Block(cfg, layer_index)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return Fp32RMSNorm(cfg.hidden_size, cfg.hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        x = self.embed(input_ids, ctx)
        dtype, positions = x.dtype, ctx.positions
        step = V4Step(ctx, PagedRows.of(ctx, kv_caches[0][0].shape[1]),
                      {label: self.angles(label, positions, dtype) for label in self.angles.inv_freq}, input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc, -1).contiguous()
        for layer, kv_cache in zip(self.layers, kv_caches):
            streams = layer(streams, kv_cache[0], step, self.angles)
        return self.norm(self.hc_head(streams))

    def weight_target(self, name: str) -> WeightTarget | None:
        """The hub's names (and transformers' for the embedding and the last hyper-connection head); the
        next-token-prediction layers (``mtp.``) are not used."""
        for pattern, replacement in RENAMES:
            name = pattern.sub(replacement, name)
        layer = LAYER_INDEX.match(name)
        if name.startswith('mtp.') or (layer is not None and int(layer.group(1)) >= len(self.layers)):
            return None
        expert = EXPERT.fullmatch(name)
        if expert is None:
            return super().weight_target(name)
        experts, index, proj = expert.groups()
        return getattr(self.get_submodule(experts), proj)[int(index)], (f'{experts}.{proj}', f'expert {index}'), None
