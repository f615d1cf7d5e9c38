"""Llama 4 (text): Llama layers whose rope layers (``no_rope_layers[i]`` 1) turn neighbouring feature pairs,
L2-normalize queries and keys after rotating them (``use_qk_norm``) and attend within chunks of
``attention_chunk_size`` positions; the other (NoPE) layers attend over everything, their queries scaled per
position (``attn_temperature_tuning``). MoE layers (``moe_layers``) route each token to its top-k experts by a
sigmoid of the router logits that scales the expert's input, plus a shared expert; dense layers are MLPs of
``intermediate_size_mlp``. The layers run in the native decoder stack (``attention_chunk``, ``qk_l2_norm_eps``,
``scaled_queries`` by the step's temperatures, MoE layers routed ``sigmoid_scaled_input``)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.activation import placeless
from lmdeploy.pytorch.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaMLP
from lmdeploy.pytorch.models.moe import MoEForCausalLM, native_experts_with_shared, split_stacked_experts
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import use_weight_format, weight_format_for
from lmdeploy.pytorch.nn.rotary import apply_rope, query_temperature
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over the last dimension, in fp32 (Llama 4's ``qk_norm``)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(LlamaAttention):
    """Rope layers: queries and keys rotated in neighbouring pairs, then L2-normalized where ``use_qk_norm``, and
    attention within chunks of ``attention_chunk_size`` positions (the layers ``layer_types`` marks
    ``chunked_attention``). NoPE layers: full attention with each query scaled by its position's
    :func:`query_temperature` (``ctx.q_scale``, see :meth:`Llama4ForCausalLM.forward`) where
    ``attn_temperature_tuning``."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        hf = cfg.hf_config
        use_rope = bool(hf.no_rope_layers[layer_index])
        super().__init__(cfg, use_rope=use_rope, interleaved_rope=True, qk_norm=False,
                         scaled_queries=bool(hf.attn_temperature_tuning) and not use_rope)
        self.l2_norm_eps = hf.rms_norm_eps if use_rope and hf.use_qk_norm else None
        chunked = hf.layer_types[layer_index] == 'chunked_attention'
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   cfg.quant_policy, attention_chunk=hf.attention_chunk_size if chunked else None)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, :self.num_heads + self.num_kv_heads], qkv[:, self.num_heads + self.num_kv_heads:]
        if self.use_rope:
            qk = apply_rope(qk, ctx.cos, ctx.sin, interleaved=True)
        if self.l2_norm_eps is not None:
            qk = l2_norm(qk, self.l2_norm_eps)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        if self.scaled_queries:
            q = (q * ctx.q_scale[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, kv_cache, ctx))


class Llama4MoE(nn.Module):
    """Each token goes to its top-k experts (``num_experts_per_tok``) by router logit; the sigmoid of that logit
    scales the token on its way INTO the expert. A shared expert of the same size sees every token unscaled."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.top_k = hf.num_experts_per_tok
        with use_weight_format(weight_format_for(None)):  # quantized checkpoints keep the router dense
            self.router = Linear(cfg.hidden_size, hf.num_local_experts)
        self.experts = FusedExperts(cfg.hidden_size, hf.intermediate_size, hf.num_local_experts)
        self.shared_expert = LlamaMLP(cfg, hf.intermediate_size)

    def native_moe(self, small_step: bool = False) -> object | None:
        """This block as a ``MoEBlock`` of :class:`~lmdeploy.pytorch.nn.decoder_stack.NativeDecoderStack` with
        routing ``sigmoid_scaled_input`` (its router on the kernel of its forward, its shared expert ungated;
        ``small_step``: for steps of at most ``small_step_rows`` tokens, which only the shared expert's projections
        tell apart); None where a part runs on no native kernel."""
        kernels = cpu.native()
        if kernels is None:
            return None
        native = native_experts_with_shared(self.experts, self.shared_expert, small_step)
        router = self.router.kernel.router_projection(self.router.bias)
        if native is None or router is None:
            return None
        return kernels.MoEBlock(router=router, top_k=self.top_k, renormalize=False, routing='sigmoid_scaled_input',
                                **native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        scores = placeless(torch.sigmoid, logits.float(), x.dtype).to(x.dtype)
        routed = (x.unsqueeze(1) * scores.unsqueeze(-1)).flatten(0, 1)  # [T * k, H]: token t's k-th copy, scaled
        ones = torch.ones(routed.shape[0], 1, dtype=torch.float32, device=x.device)
        out = self.experts(routed, ones, ids.reshape(-1, 1)).view(x.shape[0], self.top_k, -1).sum(1)
        return out + self.shared_expert(x)


class Llama4DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with Llama 4's attention."""

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """See :meth:`LlamaDecoderLayer.native_weights`; the stack's layer has the attention chunk and the L2 q/k
        norm of its attention too."""
        attn = self.self_attn
        return self.stack_weights(small_step, attention_chunk=attn.attn.attention_chunk,
                                  qk_l2_norm_eps=attn.l2_norm_eps)


class Llama4ForCausalLM(MoEForCausalLM):
    """Llama 4's text decoder (``Llama4ForCausalLM``); checkpoint names ``feed_forward`` the layers' ``mlp``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        self.temperature = (hf.floor_scale, hf.attn_scale) if hf.attn_temperature_tuning else None

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.forward`; first the NoPE layers' query temperature of each token (fp32)."""
        if self.temperature is not None:
            ctx.q_scale = query_temperature(ctx.positions, *self.temperature, offset=1, log1p=True)
        return super().forward(input_ids, kv_caches, ctx)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return Llama4DecoderLayer(cfg, self.make_mlp(cfg, layer_index), Llama4Attention(cfg, layer_index))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        return Llama4MoE(cfg) if layer_index in hf.moe_layers else LlamaMLP(cfg, hf.intermediate_size_mlp)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Also renames ``feed_forward`` to ``mlp`` and splits the stacked experts ``gate_up_proj [E, H, 2I]``
        and ``down_proj [E, I, H]`` (:func:`split_stacked_experts`)."""
        renamed = ((name.replace('.feed_forward.', '.mlp.'), tensor) for name, tensor in weights)
        return split_stacked_experts(super().split_fused(renamed), self.cfg.hidden_size, hub_layout_only=True)
