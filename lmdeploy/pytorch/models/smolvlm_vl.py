"""SmolVLM and SmolVLM2 (``SmolVLMForConditionalGeneration``: SmolVLM-256M/500M/2.2B-Instruct) and their parent
Idefics3 (``Idefics3ForConditionalGeneration``): a Llama language model (SmolLM2 for SmolVLM) fed by transformers'
own vision tower (SigLIP-style, positions from the patch attention mask) and connector (a pixel shuffle by
``scale_factor``, then ``modality_projection``).

An image is cut into tiles of the tower's size plus a global tile of the whole image; each tile gives
``(image_size / patch_size)**2 / scale_factor**2`` features. Its span in the prompt is the text transformers'
processor writes for it (``<fake_token_around_image>``, ``<row_r_col_c>`` before each tile, line breaks after each
row of tiles, ``<global-img>`` before the global one); only its ``<image>`` tokens take features, which the
image's ``placeholder_mask`` (from the processor, checked against the span by the engine) marks.
"""
from __future__ import annotations

import torch
from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import WeightTarget
from lmdeploy.pytorch.models.vision_language import VisionLanguageModel
from lmdeploy.pytorch.multimodal import MultiModalInput

# model_type -> transformers' vision tower and connector
TOWERS = {'smolvlm': (SmolVLMVisionTransformer, SmolVLMConnector),
          'idefics3': (Idefics3VisionTransformer, Idefics3Connector)}
TEXT_PREFIX = 'text_model.'
CONNECTOR_PREFIX = 'connector.'  # the tower's 'vision_model.' is VisionLanguageModel's


def tokens_per_tile(config) -> int:
    """Features of one tile after the connector's pixel shuffle (transformers' ``image_seq_len``)."""
    vision = config.vision_config
    return int((vision.image_size // vision.patch_size)**2 / config.scale_factor**2)


class SmolVLMForConditionalGeneration(VisionLanguageModel):
    """The Llama language model plus the vision tower and connector of SmolVLM or Idefics3."""

    def __init__(self, cfg: ModelConfig):
        mm = cfg.mm_config
        if mm.text_config.model_type != 'llama':
            raise ValueError(f'{mm.model_type} with a {mm.text_config.model_type!r} language model is not supported; '
                             'supported: llama')
        super().__init__(cfg)
        tower, connector = TOWERS[mm.model_type]
        self.vision_model = tower._from_config(mm.vision_config)
        self.connector = connector(mm)
        self.image_token_id = mm.image_token_id
        self.tokens_per_tile = tokens_per_tile(mm)
        vision = mm.vision_config
        self.tile_shape = (vision.num_channels, vision.image_size, vision.image_size)
        self.requires_grad_(False)

    def weight_target(self, name: str) -> WeightTarget | None:
        """The language model's tensors (``text_model.*``) as a Llama's; the tower's and connector's as named."""
        name = name.removeprefix(TEXT_PREFIX)
        if not name.startswith(CONNECTOR_PREFIX):
            return super().weight_target(name)
        try:
            return self.get_parameter(name), name, None
        except AttributeError:
            return None

    def placeholder_mask(self, image: MultiModalInput) -> list[bool]:
        """The ``<image>`` tokens of the image's span, checked against its tiles of pixels."""
        pixels, mask = image.data.get('pixel_values'), image.data.get('placeholder_mask')
        if pixels is None or mask is None or pixels.dim() != 4 or tuple(pixels.shape[1:]) != self.tile_shape:
            raise ValueError(f"an image needs its 'pixel_values' [tiles, {', '.join(map(str, self.tile_shape))}] and "
                             f"'placeholder_mask', got {sorted(image.data)}")
        if tuple(mask.shape) != (image.length, ) or int(mask.sum()) != len(pixels) * self.tokens_per_tile:
            raise ValueError(f'an image of {len(pixels)} tiles takes {len(pixels) * self.tokens_per_tile} <image> '
                             f'tokens in its span of {image.length}, got a mask of {int(mask.sum())} in '
                             f'{mask.numel()}')
        return mask.tolist()

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        """Features laid out as the images' spans: one row per span token, zeros where no ``<image>`` is."""
        hidden = self.vision_model(pixel_values=self._pixels(inputs)).last_hidden_state
        features = self.connector(hidden).flatten(0, 1)
        spans = []
        start = 0
        for image in inputs:
            mask = image.data['placeholder_mask'].to(features.device)
            span = features.new_zeros(image.length, features.shape[-1])
            span[mask] = features[start:start + int(mask.sum())]
            start += int(mask.sum())
            spans.append(span)
        return torch.cat(spans)
