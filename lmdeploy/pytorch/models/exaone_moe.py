"""K-EXAONE (``ExaoneMoeForCausalLM``): Llama's pre-norm layers with EXAONE 4's attention (q/k RMSNorms per head
before the rotary; where the config has a ``sliding_window``, its sliding layers per ``layer_types`` rotate and the
full ones do not) over DeepSeek-V3's mixture of experts (an fp32 router, sigmoid grouped top-k with a correction
bias, ``routed_scaling_factor``, ungated shared experts), the layers that ``mlp_layer_types`` marks ``dense`` with
Llama's MLP. Its layers run in the native decoder stack as GLM-4.5's do."""
from __future__ import annotations

from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3MoE
from lmdeploy.pytorch.models.gemma import SLIDING_ATTENTION
from lmdeploy.pytorch.models.glm4_moe import Glm4MoeForCausalLM
from lmdeploy.pytorch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, WeightTarget, layer_window


class ExaoneMoeForCausalLM(Glm4MoeForCausalLM):
    """K-EXAONE's decoder; the hub checkpoints' ``mlp.e_score_correction_bias`` loads as the router's."""

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        use_rope = not hf.sliding_window or hf.layer_types[layer_index] == SLIDING_ATTENTION
        attn = LlamaAttention(cfg, use_rope=use_rope, sliding_window=layer_window(hf, layer_index), qk_norm=True)
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return DeepseekV3MoE(cfg) if cfg.hf_config.mlp_layer_types[layer_index] == 'sparse' else LlamaMLP(cfg)

    def weight_target(self, name: str) -> WeightTarget | None:
        return super().weight_target(name.replace('.mlp.e_score_correction_bias', '.mlp.gate.e_score_correction_bias'))
