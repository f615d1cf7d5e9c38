"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``, Xiaomi): Laguna's decoder (layer types with a rope each, dense or
mixture-of-experts layers by ``mlp_layer_types``) with attention of its own: queries and keys of ``head_dim`` features,
values of ``v_head_dim``, scaled by ``attention_value_scale``; the sliding-window layers have twice the KV heads of the
full ones and a learned sink logit per head; no q/k norms nor gate. Its MoE is DeepSeek-V3's without shared experts
(grouped sigmoid top-k over an fp32 router with a correction bias). The checkpoints' next-token-prediction layers
(``model.mtp.*``) are not used.

The KV cache has one shape for every layer: the sliding layers' KV heads (``config.SLIDING_KV_HEADS_FACTOR``) of
``head_dim`` features, so a full layer stores each KV head twice (attention is unchanged: each query head reads the
copy of its own KV head) and values are zero-padded from ``v_head_dim`` to ``head_dim`` (the padding's outputs are
dropped). Its layers do not run in the native decoder stack (no value head size of its own there)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.distributed.parallel_state import Shard, current_group, head_ranges
from lmdeploy.pytorch.models.gemma import SLIDING_ATTENTION
from lmdeploy.pytorch.models.laguna import LagunaForCausalLM, LayerTypeDecoderLayer
from lmdeploy.pytorch.models.llama import KVCache, WeightTarget, layer_window
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.nn.linear import MergedLinear, RowLinear
from lmdeploy.pytorch.nn.rotary import apply_rope
from lmdeploy.pytorch.step_context import StepContext

# the hub's name of the sinks (transformers renames it ``sinks``), and the prefix of its next-token-prediction layers
HUB_SINKS = '.self_attn.attention_sink_bias'
MTP_PREFIX = 'mtp.'


class MiMoV2FlashAttention(nn.Module):
    """Attention with values narrower than queries and keys (``v_head_dim``) and scaled by ``attention_value_scale``,
    the layer type's rope on the first ``partial_rotary_factor`` of the query and key features; the sliding-window
    layers with twice the KV heads and a sink logit per head. Each tensor-parallel rank holds its query heads, the KV
    heads they read and those heads' sinks."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        hf = cfg.hf_config
        sliding = hf.layer_types[layer_index] == SLIDING_ATTENTION
        num_heads, num_kv_heads = hf.num_attention_heads, hf.num_key_value_heads * (2 if sliding else 1)
        self.head_dim, self.v_head_dim = hf.head_dim, hf.v_head_dim
        tp = current_group()
        (q_start, q_stop), (kv_start, kv_stop) = head_ranges(num_heads, num_kv_heads, tp.rank, tp.world_size)
        self.num_heads, self.num_kv_heads = q_stop - q_start, kv_stop - kv_start
        self.q_heads = (q_start, q_stop)
        dims = (self.head_dim, self.head_dim, self.v_head_dim)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [num_heads * dims[0], num_kv_heads * dims[1],
                                                       num_kv_heads * dims[2]], bias=bool(hf.attention_bias),
                                     ranges=[(q_start * dims[0], q_stop * dims[0])]
                                     + [(kv_start * dim, kv_stop * dim) for dim in dims[1:]])
        self.o_proj = RowLinear(num_heads * self.v_head_dim, cfg.hidden_size,
                                in_range=(q_start * self.v_head_dim, q_stop * self.v_head_dim))
        scale = hf.attention_value_scale
        self.value_scale = 1.0 if scale is None else scale
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   cfg.quant_policy, sliding_window=layer_window(hf, layer_index), with_sinks=sliding)

    def sinks_part(self) -> tuple[torch.Tensor, Shard | None]:
        """The sinks of this rank's heads and the part of the checkpoint's sinks they hold."""
        return self.attn.sinks, Shard(0, *self.q_heads) if self.qkv_proj.sharded else None

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                          self.num_kv_heads * self.v_head_dim], dim=-1)
        q = apply_rope(q.reshape(-1, self.num_heads, self.head_dim), ctx.cos, ctx.sin)
        k = apply_rope(k.reshape(-1, self.num_kv_heads, self.head_dim), ctx.cos, ctx.sin)
        v = F.pad(v.reshape(-1, self.num_kv_heads, self.v_head_dim) * self.value_scale,
                  (0, self.head_dim - self.v_head_dim))
        copies = kv_cache[0].shape[1] // self.num_kv_heads
        if copies > 1:
            k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        out = self.attn(q, k, v, kv_cache, ctx).view(-1, self.num_heads, self.head_dim)[..., :self.v_head_dim]
        return self.o_proj(out.flatten(1))


class MiMoV2FlashForCausalLM(LagunaForCausalLM):
    """MiMo-V2-Flash's decoder: :class:`MiMoV2FlashAttention` in Laguna's layers, DeepSeek-V3's MoE without shared
    experts; the hub's ``attention_sink_bias`` loads as each sliding layer's sinks, the ``mtp`` layers are skipped."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LayerTypeDecoderLayer(cfg, layer_index, self.make_mlp(cfg, layer_index),
                                     MiMoV2FlashAttention(cfg, layer_index))

    def weight_target(self, name: str) -> WeightTarget | None:
        if name.startswith(MTP_PREFIX):
            return None
        name = name.replace(HUB_SINKS, '.self_attn.sinks')
        if name.endswith('.self_attn.sinks'):
            param, shard = self.get_submodule(name.removesuffix('.sinks')).sinks_part()
            return param, name.replace('.sinks', '.attn.sinks'), shard
        return super().weight_target(name)
