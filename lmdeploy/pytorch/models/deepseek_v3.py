"""DeepSeek-V3 (and V2, and Mistral Small 4's language model): multi-head latent attention over a latent KV cache,
YaRN with DeepSeek's softmax mscale, grouped top-k routing (V3: sigmoid scores with a correction bias; V2: softmax,
greedy or group-limited; Mistral 4: softmax scores grouped as V3's, its queries scaled by position), shared experts
and dense first layers."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers.modeling_rope_utils import yarn_apply_mscale

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import cpu, group_limited_topk, grouped_topk, moe_routing
from lmdeploy.pytorch.models.llama import DECODE_INT4_LAYERS, KVCache, LlamaDecoderLayer, LlamaMLP, WeightTarget
from lmdeploy.pytorch.models.moe import MoEForCausalLM, native_experts_with_shared, split_stacked_experts
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights, NativeDecoderStack, latent_attention, layer_weights
from lmdeploy.pytorch.nn.linear import Linear, RowLinear
from lmdeploy.pytorch.nn.mla import HeadsLinear, LatentAttention
from lmdeploy.pytorch.nn.moe import Fp32Router, FusedExperts
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.quant import Layout, LinearOptions, new_parameter
from lmdeploy.pytorch.nn.rotary import apply_rope, position_query_scale, scale_queries
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

LORA_NORM_EPS = 1e-6  # the q_a/kv_a norms keep RMSNorm's default, whatever rms_norm_eps says
LAYER_INDEX = re.compile(r'layers\.(\d+)\.')


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention: queries from a low-rank projection (or a plain one without
    ``q_lora_rank``), keys and values from the cached latent, each head's rotary part from the shared
    rotary key. With ``lora_scales`` (LongCat-Flash) the queries are scaled by ``sqrt(hidden / q_lora_rank)`` and
    the normed latent by ``sqrt(hidden / kv_lora_rank)``. Where the rope names a ``llama_4_scaling_beta`` (Mistral 4),
    the queries are scaled by their position (the step's ``q_scale``, see
    :func:`~lmdeploy.pytorch.nn.rotary.position_query_scale`)."""

    def __init__(self, cfg: ModelConfig, lora_scales: bool = False):
        super().__init__()
        hf = cfg.hf_config
        num_heads, self.kv_lora_rank = hf.num_attention_heads, hf.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim
        # V2 turns neighbouring pairs (complex rotary); V3 too unless ``rope_interleave`` is off
        self.interleaved_rope = bool(getattr(hf, 'rope_interleave', True))
        self.scaled_queries = position_query_scale(hf) is not None
        qk_head_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(hf, 'attention_bias', False))
        self.q_lora = hf.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = HeadsLinear(cfg.hidden_size, num_heads, qk_head_dim)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, hf.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(hf.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = HeadsLinear(hf.q_lora_rank, num_heads, qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = HeadsLinear(self.kv_lora_rank, num_heads, self.nope_dim + self.v_head_dim)
        self.num_heads = self.kv_b_proj.num_heads  # this rank's
        first, last = self.kv_b_proj.heads
        self.o_proj = RowLinear(num_heads * self.v_head_dim, cfg.hidden_size, bias=bias,
                                in_range=(first * self.v_head_dim, last * self.v_head_dim))
        self.lora_scales = ((cfg.hidden_size / hf.q_lora_rank)**0.5, (cfg.hidden_size / self.kv_lora_rank)**0.5
                            ) if lora_scales else None
        scale = yarn_apply_mscale(getattr(hf, 'rope_parameters', None) or {}, qk_head_dim**-0.5)
        self.attn = LatentAttention(self.num_heads, self.kv_lora_rank, self.nope_dim, self.v_head_dim, scale,
                                    cfg.quant_policy)

    def native_attention(self, small_step: bool = False) -> object | None:
        """This attention up to its ``o_proj`` as the ``mla`` of a layer of
        :class:`~lmdeploy.pytorch.nn.decoder_stack.NativeDecoderStack` (``small_step``: for steps of at most
        ``small_step_rows`` tokens); None where a projection runs on no native GEMM. ``kv_a_proj_with_mqa``, whose
        outputs the int8 GEMM's panels may not fit, may run on torch's int8 GEMM (its ``router_projection``), as it
        does in the layer. None with ``lora_scales`` too (the stack has no such scales)."""
        kv_a = self.kv_a_proj_with_mqa.kernel.router_projection(self.kv_a_proj_with_mqa.bias)
        if kv_a is None or self.lora_scales is not None:
            return None
        if self.q_lora:
            queries = dict(q_a=self.q_a_proj, q=self.q_b_proj)
            norm = dict(q_a_norm=self.q_a_layernorm.weight)
        else:
            queries, norm = dict(q=self.q_proj), {}
        return latent_attention(queries, small_step, **norm, kv_a=kv_a, kv_a_norm=self.kv_a_layernorm.weight, kv_b=self.kv_b_proj.weight,
                                num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank, nope_dim=self.nope_dim,
                                rope_dim=self.rope_dim, v_head_dim=self.v_head_dim,
                                interleaved_rope=self.interleaved_rope, scale=self.attn.scale,
                                norm_eps=LORA_NORM_EPS, scaled_queries=self.scaled_queries)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        _, q_nope, q_rope, latent = self.queries_and_latent(x, ctx)
        return self.o_proj(self.attn(q_nope, q_rope, latent, self.kv_b_proj.weight, kv_cache, ctx))

    def queries_and_latent(self, x: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor | None, torch.Tensor,
                                                                               torch.Tensor, torch.Tensor]:
        """``(q_lora, q_nope, q_rope, latent)`` of ``x [T, hidden]``: the normed low-rank query ``[T, q_lora_rank]``
        (None without ``q_lora_rank``), each head's query parts (the rotary one turned) and the latent to cache
        (normed latent, then turned rotary key)."""
        q_lora = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else None
        q = self.q_b_proj(q_lora) if self.q_lora else self.q_proj(x)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        if self.lora_scales is not None:
            q, latent = q * self.lora_scales[0], latent * self.lora_scales[1]
        q_nope, q_rope = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope.contiguous(), ctx.cos, ctx.sin, self.interleaved_rope)
        if self.scaled_queries:
            q_nope, q_rope = scale_queries(q_nope, ctx.q_scale), scale_queries(q_rope, ctx.q_scale)
        k_rope = apply_rope(k_rope.unsqueeze(1).contiguous(), ctx.cos, ctx.sin, self.interleaved_rope).squeeze(1)
        latent = torch.cat((latent, k_rope), dim=-1)
        return q_lora, q_nope, q_rope, latent


class TopKRouter(Fp32Router):
    """The fp32 router (:class:`Fp32Router`) and, with V3's routing, its ``e_score_correction_bias [E]`` (fp32)."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool):
        super().__init__(hidden_size, num_experts)
        if correction_bias:
            self.e_score_correction_bias = new_parameter((num_experts,), Layout(None, None), torch.float32)


ROUTINGS = ('noaux_tc', 'softmax_noaux_tc', 'greedy', 'group_limited_greedy')
# the model types that route by grouped_topk, whatever topk_method
NOAUX_TC_MODEL_TYPES = ('deepseek_v3', 'glm4_moe', 'glm4_moe_lite', 'glm4v_moe_text', 'dots1', 'exaone_moe', 'afmoe',
                        'deepseek_v32', 'glm_moe_dsa', 'laguna', 'mimo_v2_flash')
# the model types that route by grouped_topk over softmax scores, without correction bias (Mistral 4)
SOFTMAX_NOAUX_TC_MODEL_TYPES = ('mistral4',)


class DeepseekV3MoE(nn.Module):
    """Routed experts plus shared experts every token runs. V3 (and GLM-4.5) route by :func:`grouped_topk`
    (``noaux_tc``), Mistral 4 by it over softmax scores without correction bias (``softmax_noaux_tc``); V2 by its
    ``topk_method``: softmax top-k (``greedy``) or :func:`group_limited_topk`, never renormalized."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.routing = ('noaux_tc' if hf.model_type in NOAUX_TC_MODEL_TYPES else 'softmax_noaux_tc'
                        if hf.model_type in SOFTMAX_NOAUX_TC_MODEL_TYPES else hf.topk_method)
        if self.routing not in ROUTINGS:
            raise ValueError(f'topk_method {self.routing!r} is not supported; supported: {ROUTINGS}')
        # Trinity's (AFMoE's) config has no groups, always renormalizes and names the scaling ``route_scale``;
        # Laguna's names it ``moe_routed_scaling_factor``
        self.top_k = hf.num_experts_per_tok
        self.num_groups, self.topk_groups = getattr(hf, 'n_group', 1), getattr(hf, 'topk_group', 1)
        self.renormalize = bool(getattr(hf, 'norm_topk_prob', True))
        self.scaling = (getattr(hf, 'routed_scaling_factor', None) or getattr(hf, 'moe_routed_scaling_factor', None)
                        or hf.route_scale)
        # K-EXAONE's config names the counts ``num_experts`` and ``num_shared_experts``
        num_experts = getattr(hf, 'n_routed_experts', None) or hf.num_experts
        num_shared = getattr(hf, 'n_shared_experts', None) or getattr(hf, 'num_shared_experts', 0)
        self.gate = TopKRouter(cfg.hidden_size, num_experts, self.routing == 'noaux_tc')
        self.experts = FusedExperts(cfg.hidden_size, hf.moe_intermediate_size, num_experts)
        self.shared_experts = LlamaMLP(cfg, hf.moe_intermediate_size * num_shared) if num_shared else None

    def native_moe(self, small_step: bool = False) -> object | None:
        """This block as a ``MoEBlock`` of :class:`~lmdeploy.pytorch.nn.decoder_stack.NativeDecoderStack` with its
        routing (``noaux_tc``, Mistral 4's as ``softmax`` where it keeps every group and scales no weight, or V2's
        ``greedy`` or ``group_limited_greedy``; its fp32 router an ``fp32``
        projection, its shared experts ungated; ``small_step``: for steps of at most ``small_step_rows`` tokens,
        which only the shared experts' projections tell apart); None where a part runs on no native kernel."""
        kernels = cpu.native()
        native = None if kernels is None else native_experts_with_shared(self.experts, self.shared_experts, small_step)
        router = self.gate.native_projection()
        if native is None or router is None:
            return None
        if self.routing == 'softmax_noaux_tc':
            if self.topk_groups != self.num_groups or self.scaling != 1.0:
                return None
            return kernels.MoEBlock(router=router, top_k=self.top_k, routing='softmax', renormalize=self.renormalize,
                                    **native)
        routing = dict(renormalize=False)  # V2's: never renormalized
        if self.routing == 'noaux_tc':
            routing = dict(renormalize=self.renormalize, correction_bias=self.gate.e_score_correction_bias)
        if self.routing != 'greedy':
            routing.update(num_groups=self.num_groups, topk_groups=self.topk_groups)
        return kernels.MoEBlock(router=router, top_k=self.top_k,
                                routing=self.routing, scaling=float(self.scaling), **routing, **native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(self.gate(x))
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] fp32, topk_ids [T, k])`` of the fp32 router logits."""
        if self.routing in ('noaux_tc', 'softmax_noaux_tc'):
            softmax = self.routing == 'softmax_noaux_tc'
            return grouped_topk(logits, None if softmax else self.gate.e_score_correction_bias, self.top_k,
                                self.num_groups, self.topk_groups, self.renormalize, self.scaling, softmax=softmax)
        if self.routing == 'greedy':
            weights, ids = moe_routing(logits, self.top_k, False)
        else:
            weights, ids = group_limited_topk(logits, self.top_k, self.num_groups, self.topk_groups)
        return weights * self.scaling, ids


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """A decoder layer of :class:`DeepseekV3Attention` and a dense MLP or :class:`DeepseekV3MoE`."""

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """As :meth:`LlamaDecoderLayer.native_weights`, its attention the stack's ``mla``; None where a part runs on
        no native kernel."""
        mla, mlp = self.self_attn.native_attention(small_step), self.mlp_weights(small_step)
        if mla is None or mlp is None:
            return None
        projections, moe = mlp
        return layer_weights(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                             dict(**projections, o=self.self_attn.o_proj), small_step, rotary_dim=0, mla=mla, **moe)


class DeepseekV3ForCausalLM(MoEForCausalLM):
    """DeepSeek-V3 and V2: the first ``first_k_dense_replace`` layers dense, the others mixtures of experts; every
    layer's attention is :class:`DeepseekV3Attention` over its latent cache (``ModelConfig.kv_latent_dim``)."""

    # only the MLPs' projections are stacked (``q_proj`` is a plain projection here)
    stacked_params = {'gate_proj': ('gate_up_proj', 0), 'up_proj': ('gate_up_proj', 1)}

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return DeepseekV3DecoderLayer(cfg, self.make_mlp(cfg, layer_index), DeepseekV3Attention(cfg))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        return LlamaMLP(cfg) if layer_index < hf.first_k_dense_replace else DeepseekV3MoE(cfg)

    def weight_target(self, name: str) -> WeightTarget | None:
        """As :meth:`MoEForCausalLM.weight_target`; the checkpoint's layers past ``num_hidden_layers`` (V3's
        multi-token-prediction layer) are not used."""
        layer = LAYER_INDEX.match(name)
        if layer is not None and int(layer.group(1)) >= len(self.layers):
            return None
        return super().weight_target(name)

    def finalize_weights(self, pack_cpu: bool, small_step_int4: bool) -> None:
        """As :meth:`LlamaForCausalLM.finalize_weights`, except that ``kv_b_proj`` stays dense (attention reads
        its rows, see :class:`LatentAttention`)."""
        rows = self.finalize_layers(pack_cpu, small_step_int4)
        if not pack_cpu:
            return
        # decode rows take the small stack whatever the layers' bounds; outside an engine step, steps of up to the
        # smallest. The stack's head sizes are the latent attention's own (its attention options are unset)
        small = [layer.native_weights(small_step=True) for layer in self.layers] if rows else None
        attn = self.layers[0].self_attn
        self.native_stack = NativeDecoderStack.build(
            [layer.native_weights() for layer in self.layers], small, attn.num_heads, 1, attn.nope_dim + attn.rope_dim,
            self.norm.eps, attn.attn.scale, min(rows, default=0), self.cfg.quant_policy)

    def finalize_layers(self, pack_cpu: bool, small_step_int4: bool) -> set[int]:
        """Lays out the layers' and the LM head's weights for their kernels (``kv_b_proj`` dense, each latent
        attention's heads packed); returns the bounds of the small-step kernels (``small_step_rows``, but 0)."""
        rows = set()
        for name, module in self.layers.named_modules():
            if isinstance(module, Linear):
                dense = name.endswith('kv_b_proj')
                module.finalize(LinearOptions(pack_cpu and not dense, small_step_int4 and not dense
                                              and name.endswith(DECODE_INT4_LAYERS), self.cfg.dtype))
                rows.add(module.kernel.small_step_rows)
            elif isinstance(module, FusedExperts):
                module.finalize(LinearOptions(pack_cpu, dtype=self.cfg.dtype))
                rows.add(module.kernel.small_step_rows)
            elif isinstance(module, Fp32Router):
                module.finalize()
            elif isinstance(module, DeepseekV3Attention):
                module.attn.pack_heads(module.kv_b_proj.weight)
        if small_step_int4:
            self.lm_head.enable_small_step_copy()
        self.lm_head.finalize(pack_cpu)
        return rows - {0}


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral Small 4's language model: DeepSeek-V3's layers, routed by softmax (``softmax_noaux_tc``), its queries
    scaled by position (``llama_4_scaling_beta``); its checkpoints stack the experts (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``), split here into per-expert weights."""

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        return split_stacked_experts(super().split_fused(weights), self.cfg.hidden_size)
