"""Qwen3.5 and Qwen3.5-MoE with images (the hub's ``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``): the Qwen3-Next-style hybrid language model of ``qwen3_next.py`` fed by
transformers' Qwen3.5 vision tower. The tower is Qwen3-VL's (learned position grid resampled bilinearly to each
image, 2-D rotary, a ``spatial_merge_size`` square of patches merged into one token) without deepstack: only its
merged output enters the language model, in place of the image placeholders. The full-attention layers take
interleaved M-RoPE positions (``mrope_section`` of the rotating ``partial_rotary_factor`` of each head), laid out
as Qwen2-VL's; the linear-attention layers take no positions."""
from __future__ import annotations

from lmdeploy.pytorch.models.qwen3_next import Qwen3NextForCausalLM
from lmdeploy.pytorch.models.vision_language import Qwen2VLForConditionalGeneration


class Qwen3_5ForConditionalGeneration(Qwen2VLForConditionalGeneration, Qwen3NextForCausalLM):
    """Qwen3.5's hybrid decoder (dense or MoE) with its vision tower, the image features entering through
    :meth:`VisionLanguageModel.embed`; the linear-attention layers' recurrent states are those of the text model."""
