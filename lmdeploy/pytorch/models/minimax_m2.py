"""MiniMax-M2 and M2.1 (``MiniMaxM2ForCausalLM``): Llama layers whose queries and keys are RMS-normed over the
whole projection, all heads together (as OLMo 2's are), before a rotary over the first ``rotary_dim`` features of
each head (in halves); every layer a mixture of experts routed as DeepSeek-V3 routes with one group: sigmoid
scores, the top-k chosen by score plus ``e_score_correction_bias``, their unbiased scores renormalized and not
scaled; no shared experts. The layers run in the native decoder stack (``qk_norm_across_heads``, the MoE layers as
``MoEBlock``s routed ``noaux_tc``)."""
from __future__ import annotations

from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE, TopKRouter
from lmdeploy.pytorch.models.llama import LlamaForCausalLM, WeightTarget
from lmdeploy.pytorch.models.olmo import OlmoAttention, OlmoAttentionDecoderLayer
from lmdeploy.pytorch.nn.moe import FusedExperts


class MiniMaxM2MoE(DeepseekV3MoE):
    """:class:`DeepseekV3MoE`'s ``noaux_tc`` routing over one group of ``num_local_experts``, renormalized,
    unscaled, without shared experts; its forward and native block are DeepSeek-V3's."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)  # DeepseekV3MoE's reads DeepSeek's config names
        hf = cfg.hf_config
        self.routing, self.top_k, self.num_groups, self.topk_groups = 'noaux_tc', hf.num_experts_per_tok, 1, 1
        self.renormalize, self.scaling = True, 1.0
        self.gate = TopKRouter(cfg.hidden_size, hf.num_local_experts, correction_bias=True)
        self.experts = FusedExperts(cfg.hidden_size, hf.intermediate_size, hf.num_local_experts)
        self.shared_experts = None


class MiniMaxM2ForCausalLM(DeepseekV3ForCausalLM):
    """MiniMax-M2's decoder. The checkpoints' ``block_sparse_moe`` holds the router (``gate``), its
    ``e_score_correction_bias`` and the experts' ``w1``/``w3``/``w2``."""

    stacked_params = LlamaForCausalLM.stacked_params
    finalize_weights = LlamaForCausalLM.finalize_weights

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        # full attention whatever the config's sliding_window says, as transformers' MiniMax-M2 attends
        return OlmoAttentionDecoderLayer(cfg, MiniMaxM2MoE(cfg), OlmoAttention(cfg))

    def weight_target(self, name: str) -> WeightTarget | None:
        return super().weight_target(name.replace('.block_sparse_moe.e_score_correction_bias',
                                                  '.mlp.gate.e_score_correction_bias'))
