"""Gemma 3 with images (``Gemma3ForConditionalGeneration``: gemma-3-4b/12b/27b-it): the Gemma 3 text model fed
by transformers' SigLIP tower and ``Gemma3MultiModalProjector`` (each image average-pooled to
``mm_tokens_per_image`` tokens, soft-embedding norm, projection). An image's features replace its placeholder
embeddings after the embedding scale, and its tokens attend to each other both ways in every layer
(``bidirectional_image_attention``: see ``StepContext.prefill_key_limit``)."""
from __future__ import annotations

import torch
from transformers import AutoModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.gemma import GemmaForCausalLM
from lmdeploy.pytorch.models.vision_language import VisionLanguageModel
from lmdeploy.pytorch.multimodal import MultiModalInput


class Gemma3ForConditionalGeneration(VisionLanguageModel, GemmaForCausalLM):
    """Gemma 3's language model (local and global layers) with a SigLIP vision tower."""

    bidirectional_image_attention = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        mm = cfg.mm_config
        self.vision_tower = AutoModel.from_config(mm.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(mm)
        self.requires_grad_(False)

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        hidden = self.vision_tower(pixel_values=self._pixels(inputs)).last_hidden_state
        return self.multi_modal_projector(hidden).flatten(0, 1)
