"""Mistral Small 3.1 / 3.2, Ministral 3 and Mistral Small 4 (``Mistral3ForConditionalGeneration``): a Mistral,
Ministral 3 or Mistral 4 language model fed by transformers' Pixtral vision tower (2-D rotary positions, images of any
size in whole patches) through its ``Mistral3MultiModalProjector``, which merges each ``spatial_merge_size`` square of
patches into one token.

An image's span in the prompt is a row of ``[IMG]`` tokens per row of merged patches, each row closed by
``[IMG_BREAK]`` and the last by ``[IMG_END]``; only the ``[IMG]`` tokens take the image's features.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import AutoModel
from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.vision_language import VisionLanguageModel
from lmdeploy.pytorch.multimodal import MultiModalInput

TEXT_MODEL_TYPES = ('mistral', 'ministral3', 'mistral4')


class Mistral3ForConditionalGeneration(VisionLanguageModel):
    """The Mistral or Ministral 3 language model plus the Pixtral tower and Mistral 3's projector, both
    transformers' own; with a ``mistral4`` language model (Mistral Small 4), a
    :class:`~lmdeploy.pytorch.models.mistral4_vl.MistralSmall4ForConditionalGeneration`."""

    def __new__(cls, cfg: ModelConfig) -> Mistral3ForConditionalGeneration:
        if cls is Mistral3ForConditionalGeneration and cfg.mm_config.text_config.model_type == 'mistral4':
            from lmdeploy.pytorch.models.mistral4_vl import MistralSmall4ForConditionalGeneration
            cls = MistralSmall4ForConditionalGeneration
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig):
        mm = cfg.mm_config
        if mm.text_config.model_type not in TEXT_MODEL_TYPES:
            raise ValueError(f'Mistral 3 with a {mm.text_config.model_type!r} language model is not supported; '
                             f'supported: {", ".join(TEXT_MODEL_TYPES)}')
        if not isinstance(mm.vision_feature_layer, int):
            raise ValueError(f'Mistral 3 takes one vision_feature_layer (its projector normalizes one layer), '
                             f'got {mm.vision_feature_layer!r}')
        # the hub's configs set the flag only in text_config; transformers 5 defaults the top-level one to true and
        # unties again when the checkpoint holds an output layer of its own
        super().__init__(dataclasses.replace(cfg, tie_word_embeddings=bool(mm.text_config.tie_word_embeddings)))
        self.vision_tower = AutoModel.from_config(mm.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(mm)
        self.feature_layer = mm.vision_feature_layer
        self.image_token_id = mm.image_token_id
        self.merged_patch = mm.vision_config.patch_size * mm.spatial_merge_size
        self.requires_grad_(False)

    def _grid(self, image: MultiModalInput) -> tuple[int, int]:
        """Rows and columns of the image's merged patches."""
        sizes = image.data.get('image_sizes')
        if sizes is None or tuple(sizes.shape) != (1, 2):
            raise ValueError(f"a Mistral 3 image needs its 'image_sizes' [[height, width]], got {sizes!r}")
        height, width = (int(side) for side in sizes[0])
        return height // self.merged_patch, width // self.merged_patch

    def placeholder_mask(self, image: MultiModalInput) -> list[bool]:
        rows, cols = self._grid(image)
        if rows * (cols + 1) != image.length:
            raise ValueError(f'an image of {rows} x {cols} merged patches spans {rows * (cols + 1)} tokens, '
                             f'not {image.length}')
        return ([True] * cols + [False]) * rows

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        """Features laid out as the images' spans: one row per span token, zeros at the row ends."""
        sizes = torch.cat([m.data['image_sizes'] for m in inputs])
        height, width = (int(side) for side in sizes.max(dim=0).values)
        weight = self.embed_tokens.weight
        pixels = torch.cat([F.pad(m.data['pixel_values'], (0, width - m.data['pixel_values'].shape[-1],
                                                            0, height - m.data['pixel_values'].shape[-2]))
                            for m in inputs]).to(weight.device, weight.dtype)
        sizes = sizes.to(weight.device)
        hidden = self.vision_tower(pixels, image_sizes=sizes, output_hidden_states=True).hidden_states
        features = self.multi_modal_projector(hidden[self.feature_layer].squeeze(0), sizes)
        spans = []
        for image, image_features in zip(inputs, features.split([r * c for r, c in map(self._grid, inputs)])):
            rows, cols = self._grid(image)
            span = image_features.new_zeros(rows, cols + 1, image_features.shape[-1])
            span[:, :cols] = image_features.view(rows, cols, -1)
            spans.append(span.flatten(0, 1))
        return torch.cat(spans)
