"""GLM-4.1V-Thinking (``Glm4vForConditionalGeneration``), GLM-4.5V and GLM-4.6V (``Glm4vMoeForConditionalGeneration``)
and transformers' ``Glm46VForConditionalGeneration`` (the same model, its text model named by ``text_config``).

The vision tower is transformers' own (``Glm4vVisionModel``: a 3-D convolution over two copies of each patch, learned
positions resampled bicubically to the image's grid, 2-D rotary, RMSNorm blocks, each ``spatial_merge_size`` square
of patches merged by a convolution, then a gated MLP). Its features replace the ``<|image|>`` tokens that transformers'
processor writes between ``<|begin_of_image|>`` and ``<|end_of_image|>``; the positions are Qwen2-VL's 3-D M-RoPE
positions (:meth:`Qwen2VLForConditionalGeneration.prompt_positions`), each frequency of the rotating
``partial_rotary_factor`` of a head turned by the axis of its ``mrope_section`` band. GLM-4.1V's language model has
GLM-4-0414's layers (neighbouring pairs rotate, attention and MLP outputs normalized); GLM-4.5V's has GLM-4.5's
(halves rotate, DeepSeek-V3's mixture of experts, the next-token-prediction layer unused). Videos are not supported.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn
from transformers import AutoModel, PretrainedConfig

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.glm import GlmForCausalLM
from lmdeploy.pytorch.models.glm4_moe import Glm4MoeForCausalLM
from lmdeploy.pytorch.models.moe import split_stacked_experts
from lmdeploy.pytorch.models.vision_language import Qwen2VLForConditionalGeneration
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

LANGUAGE_MODEL = 'model.language_model.'  # the language model's tensors in the checkpoints


class Glm4vVisionLanguageModel(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's image path (3-D positions, merged features in place of the placeholders) with GLM-4V's tower."""

    def make_vision_tower(self, mm: PretrainedConfig) -> nn.Module:
        return AutoModel.from_config(mm.vision_config)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """As the language model's, the checkpoints' ``model.language_model.`` names taken as the text model's own
        ``model.``, so that GLM-4.1V's fused ``gate_up_proj`` splits."""
        return super().split_fused((f'model.{name.removeprefix(LANGUAGE_MODEL)}' if name.startswith(LANGUAGE_MODEL)
                                    else name, tensor) for name, tensor in weights)


class Glm4vForConditionalGeneration(Glm4vVisionLanguageModel, GlmForCausalLM):
    """GLM-4.1V-Thinking: GLM-4-0414's decoder with GLM-4V's vision tower."""


class Glm4vMoeForConditionalGeneration(Glm4vVisionLanguageModel, Glm4MoeForCausalLM):
    """GLM-4.5V and GLM-4.6V: GLM-4.5's mixture-of-experts decoder with GLM-4V's vision tower."""

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Also splits stacked experts into per-expert weights: the hub's checkpoints hold them per expert, as
        transformers 5 saves a ``Glm4vMoeForConditionalGeneration``, but it saves a ``Glm46VForConditionalGeneration``'s
        stacked (``[E, 2I, H]`` and ``[E, H, I]``)."""
        return split_stacked_experts(super().split_fused(weights), self.cfg.hidden_size)


class Glm46VForConditionalGeneration:
    """transformers' GLM-4.6V class: :class:`Glm4vForConditionalGeneration` or, for a ``glm4v_moe_text`` language
    model, :class:`Glm4vMoeForConditionalGeneration`."""

    tensor_parallel_refusal: str | None = None

    def __new__(cls, cfg: ModelConfig) -> Glm4vVisionLanguageModel:
        moe = cfg.hf_config.model_type == 'glm4v_moe_text'
        return (Glm4vMoeForConditionalGeneration if moe else Glm4vForConditionalGeneration)(cfg)
