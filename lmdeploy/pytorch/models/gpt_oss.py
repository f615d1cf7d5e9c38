"""gpt-oss: attention with sinks, alternating sliding-window and full layers, and a MoE of biased experts
with a clamped SwiGLU (MXFP4 checkpoints' experts are kept so, see ``nn/quant/mxfp4.py``)."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.distributed.parallel_state import Shard
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, WeightTarget, layer_window
from lmdeploy.pytorch.models.moe import MoEForCausalLM, SparseMoeBlock
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource, read_shard

# all experts of a layer in one tensor: gate_up_proj [E, H, 2I] (gate and up columns alternate),
# down_proj [E, I, H], and their biases [E, 2I] and [E, H]; in MXFP4 checkpoints the weights as ``_blocks``
# [E, out, in / 32, 16] and ``_scales`` [E, out, in / 32] instead
FUSED_EXPERTS = re.compile(r'(.*layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?')


class GptOssAttention(LlamaAttention):
    """Llama attention with q/k/v/o biases, a learned sink logit per head, and a sliding window on the
    layers ``layer_types`` marks ``sliding_attention``."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        window = layer_window(cfg.hf_config, layer_index)
        super().__init__(cfg, sliding_window=window)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   cfg.quant_policy, sliding_window=window, with_sinks=True)

    def sinks_part(self) -> tuple[torch.Tensor, Shard | None]:
        """The sinks of this rank's heads and the part of the checkpoint's ``sinks`` they hold."""
        start, stop = (bound // self.head_dim for bound in self.qkv_proj.ranges[0])
        return self.attn.sinks, Shard(0, start, stop) if self.qkv_proj.sharded else None


class GptOssForCausalLM(MoEForCausalLM):
    """gpt-oss decoder layers: :class:`GptOssAttention` and a :class:`SparseMoeBlock` in every layer."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), GptOssAttention(cfg, layer_index))

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        return SparseMoeBlock(cfg, bias=True, activation=ClampedSwiGLU(hf.swiglu_alpha, hf.swiglu_limit))

    def weight_target(self, name: str) -> WeightTarget | None:
        name = name.replace('.mlp.router.', '.mlp.gate.')
        if name.endswith('.self_attn.sinks'):
            param, shard = self.get_submodule(name.removesuffix('.sinks')).sinks_part()
            return param, name.replace('.sinks', '.attn.sinks'), shard
        return super().weight_target(name)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Also splits each layer's fused expert tensors into every expert's ``gate_proj``, ``up_proj`` and
        ``down_proj`` (weight ``[out, in]`` or MXFP4 ``blocks`` and ``scales``, and bias), the names of per-expert
        checkpoints."""
        for name, tensor in super().split_fused(weights):
            match = FUSED_EXPERTS.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            prefix, proj, suffix = match.groups()
            kind = suffix[1:] if suffix else 'weight'
            full = read_shard(tensor, None)
            if kind == 'weight':
                full = full.transpose(1, 2)  # [E, out, in]
            for expert in range(full.shape[0]):
                if proj == 'down_proj':
                    yield f'{prefix}.{expert}.down_proj.{kind}', full[expert]
                else:
                    yield f'{prefix}.{expert}.gate_proj.{kind}', full[expert, 0::2]
                    yield f'{prefix}.{expert}.up_proj.{kind}', full[expert, 1::2]
