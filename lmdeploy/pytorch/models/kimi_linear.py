"""Kimi-Linear (``KimiLinearForCausalLM``): a hybrid whose ``layer_types`` interleave Kimi Delta Attention (KDA: the
gated delta rule of Qwen3-Next's Gated DeltaNet with a decay per key feature instead of per head, over a recurrent
state per sequence, see ``paging/state_pool.py``) with DeepSeek-V3's multi-head latent attention without position
encoding (its rotary part unturned), and DeepSeek-V3's MLPs: dense where ``mlp_layer_types`` says ``dense``, else
sigmoid-routed experts with a shared one. Every step runs the layers' own forward (the native decoder stack has no
KDA layer); decode steps run the native (or Triton) delta rule and convolution kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.activation import placeless
from lmdeploy.pytorch.kernels.gated_delta import DELTA_RULE_CHUNK
from lmdeploy.pytorch.models.deepseek_v3 import (DeepseekV3Attention, DeepseekV3DecoderLayer, DeepseekV3ForCausalLM,
                                                 DeepseekV3MoE)
from lmdeploy.pytorch.models.llama import LlamaMLP, WeightTarget
from lmdeploy.pytorch.models.qwen3_next import LINEAR_ATTENTION, CausalConv1d, GatedDeltaNet, GatedRMSNorm
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.step_context import StepContext

CONV_PARTS = ('q_conv1d', 'k_conv1d', 'v_conv1d')  # the checkpoints' convolutions, stacked in this order


class StackedConv1d(CausalConv1d):
    """The q, k and v convolutions (``CONV_PARTS``, ``[channels, 1, kernel]`` each) as one of ``3 * channels``."""

    def weight_shards(self) -> dict[str, list[str]]:
        return {'weight': list(CONV_PARTS)}


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi Delta Attention: q, k and v projected and convolved apart (``q_proj``... ``q_conv1d``...), as many key as
    value heads of ``linear_head_dim`` features; a low-rank forget gate (``f_a_proj``, ``f_b_proj``) gives each head
    and key feature its log decay ``-exp(A_log) * softplus(f + dt_bias)``, ``b_proj`` each head's ``beta``; the
    output is normed per head and gated by the sigmoid of a low-rank gate (``g_a_proj``, ``g_b_proj``). The state
    pool's rows are :class:`GatedDeltaNet`'s."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        hf = cfg.hf_config
        heads, dim = hf.linear_num_heads, hf.linear_head_dim
        self.num_k_heads = self.num_v_heads = heads
        self.k_dim = self.v_dim = dim
        self.key_size = self.value_size = heads * dim
        self.conv_dim = 3 * self.key_size
        self.kernel = hf.linear_conv_kernel_dim
        self.value_heads_tiled = False
        self.q_proj, self.k_proj, self.v_proj = (Linear(cfg.hidden_size, self.key_size) for _ in range(3))
        self.conv1d = StackedConv1d(self.conv_dim, self.kernel)
        self.f_a_proj, self.f_b_proj = Linear(cfg.hidden_size, dim), Linear(dim, self.key_size)
        self.dt_bias = nn.Parameter(torch.zeros(self.key_size), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.b_proj = Linear(cfg.hidden_size, heads)
        self.g_a_proj, self.g_b_proj = Linear(cfg.hidden_size, dim), Linear(dim, self.key_size)
        self.o_norm = GatedRMSNorm(dim, hf.rms_norm_eps, torch.sigmoid)
        self.o_proj = Linear(self.key_size, cfg.hidden_size)
        self.dtype = cfg.dtype

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        beta = placeless(torch.sigmoid, self.b_proj(x))
        forget = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        decay = self.A_log.float().exp()[:, None]
        g = -decay * placeless(F.softplus, forget, self.dtype).view(-1, self.num_v_heads, self.k_dim)
        out = self.delta_rule(qkv, g, beta, state, ctx)
        gate = self.g_b_proj(self.g_a_proj(x)).view(-1, self.num_v_heads, self.v_dim)
        return self.o_proj(self.o_norm(out.to(self.dtype), gate).flatten(1))

    def weight_target(self, name: str) -> tuple[torch.Tensor, str | tuple[str, str]] | None:
        """``(destination, what it fills)`` of this layer's checkpoint tensors that are laid out otherwise here (a
        q, k or v convolution, ``A_log [1, 1, H, 1]``); None for the others. ``name`` is relative to the layer."""
        part, _, kind = name.partition('.')
        if part in CONV_PARTS:
            rows = CONV_PARTS.index(part) * self.key_size
            return self.conv1d.weight[rows:rows + self.key_size], ('conv1d.weight', part)
        if name == 'A_log':
            return self.A_log.view(1, 1, -1, 1), 'A_log'
        return None


class LatentAttentionWithoutRope(DeepseekV3Attention):
    """DeepSeek-V3's latent attention whose rotary query and key parts stay unturned (Kimi-Linear's NoPE)."""

    rotary = False


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    """Kimi-Linear (see the module's docstring)."""

    tensor_parallel_refusal = 'its delta-attention layers are not sharded for tensor parallelism'
    recurrent_chunk = DELTA_RULE_CHUNK  # where the scheduler cuts prefill chunks (``Scheduler.recurrent_grain``)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        linear = cfg.hf_config.layer_types[layer_index] == LINEAR_ATTENTION
        attn = KimiDeltaAttention(cfg) if linear else LatentAttentionWithoutRope(cfg)
        return DeepseekV3DecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaMLP(cfg) if cfg.hf_config.mlp_layer_types[layer_index] == 'dense' else DeepseekV3MoE(cfg)

    def weight_target(self, name: str) -> WeightTarget | None:
        layer, sep, rest = name.partition('.self_attn.')
        attn = self.get_submodule(f'{layer}.self_attn') if sep and layer.startswith('layers.') else None
        if isinstance(attn, KimiDeltaAttention):
            target = attn.weight_target(rest)
            if target is not None:
                dest, key = target
                key = f'{layer}.self_attn.{key}' if isinstance(key, str) else (f'{layer}.self_attn.{key[0]}', key[1])
                return dest, key, None
        return super().weight_target(name)

    def finalize_weights(self, pack_cpu: bool, small_step_int4: bool) -> None:
        """The weights laid out for their kernels; no native decoder stack (it has no KDA layer)."""
        self.finalize_layers(pack_cpu, small_step_int4)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Per layer, one sequence's recurrent state (KDA layers) or None (latent-cache layers)."""
        return [layer.self_attn.state_shapes() if isinstance(layer.self_attn, KimiDeltaAttention) else None
                for layer in self.layers]
