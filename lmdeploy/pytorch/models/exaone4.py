"""EXAONE 4.0 (``Exaone4ForCausalLM``, 1.2B and 32B): OLMo 2's layers (no norms on the inputs of attention and the
MLP, RMSNorms on their outputs before the residual adds them) with q/k RMSNorms per head; where the config has a
``sliding_window`` (32B) the layers of ``layer_types`` alternate sliding-window attention with rotary and full
attention without it (NoPE), else (1.2B) every layer is full attention with rotary. Its layers run in the native
decoder stack (as OLMo 2's, ``post_norms_only``)."""
from __future__ import annotations

from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.gemma import SLIDING_ATTENTION
from lmdeploy.pytorch.models.llama import LlamaAttention, layer_window
from lmdeploy.pytorch.models.olmo import OlmoDecoderLayer, OlmoForCausalLM


class Exaone4ForCausalLM(OlmoForCausalLM):
    """EXAONE 4.0's decoder; its per-head q/k norms split over tensor-parallel ranks with the heads."""

    tensor_parallel_refusal = None

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        window = layer_window(hf, layer_index)
        use_rope = not hf.sliding_window or hf.layer_types[layer_index] == SLIDING_ATTENTION
        attn = LlamaAttention(cfg, use_rope=use_rope, sliding_window=window, qk_norm=True)
        return OlmoDecoderLayer(cfg, layer_index, attn)
