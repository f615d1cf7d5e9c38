"""Liquid AI's LFM2-VL (``Lfm2VlForConditionalGeneration``: LFM2-VL-450M, 1.6B, 3B): the LFM2 language model (short
convolutions between attention layers, see ``lfm2.py``) fed by transformers' SigLIP2 NaFlex tower and LFM2-VL's
projector.

An image is one tile at about its own resolution, or (when large) tiles of ``tile_size`` pixels plus a thumbnail of
the whole image (``lmdeploy.vl.image_inputs.Lfm2VlImageInputs``). The tower sees each tile's patches in its own
grid (positions resized to it, the padding masked); the projector merges each ``downsample_factor`` square of patches
into one token (pixel unshuffle, LayerNorm, two linears). An image's span holds ``<|image_start|>``, a
``<|img_row_R_col_C|>`` marker before each tile's tokens and ``<|img_thumbnail|>`` before the thumbnail's where it is
cut, and ``<|image_end|>``; only the ``<image>`` tokens take features.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers import AutoModel
from transformers.models.lfm2_vl.modeling_lfm2_vl import Lfm2VlMultiModalProjector

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.lfm2 import Lfm2ForCausalLM
from lmdeploy.pytorch.models.vision_language import VISION_PREFIXES, VisionLanguageModel
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

HUB_TOWER = 'vision_tower.vision_model.'
IMAGE_KEYS = ('pixel_values', 'pixel_attention_mask', 'spatial_shapes', 'tile_grid')


class Lfm2VlForConditionalGeneration(VisionLanguageModel, Lfm2ForCausalLM):
    """The LFM2 decoder with the SigLIP2 tower and LFM2-VL's projector, both transformers' own. Each image is encoded
    on its own (its tiles in one batch), so its features do not depend on the other images of a step."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        mm = cfg.mm_config
        self.vision_tower = AutoModel.from_config(mm.vision_config)
        self.multi_modal_projector = Lfm2VlMultiModalProjector(mm)
        self.image_token_id = mm.image_token_id
        self.factor = mm.downsample_factor
        self.patch_features = mm.vision_config.num_channels * mm.vision_config.patch_size**2
        self.requires_grad_(False)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """The tower's and the projector's tensors as they are (the hub's ``vision_tower.vision_model.*``, saved
        before transformers 5 dropped that level, as ``vision_tower.*``); the language model's renamed as LFM2's
        (whose renames would also catch the tower's ``self_attn.out_proj``)."""
        for name, tensor in weights:
            name = name.removeprefix('model.')
            if name.startswith(VISION_PREFIXES):
                yield name.replace(HUB_TOWER, 'vision_tower.', 1), tensor
            else:
                yield from super().split_fused([(name.removeprefix('language_model.'), tensor)])

    def _tiles(self, image: MultiModalInput) -> tuple[list[tuple[int, int]], int, int]:
        """Each tile's patch grid (rows, columns), the image's tiles in rows x columns and whether a thumbnail
        follows them; raises ``ValueError`` for tensors that do not fit together."""
        missing = [key for key in IMAGE_KEYS if key not in image.data]
        if missing:
            raise ValueError(f'an LFM2-VL image needs its {", ".join(map(repr, IMAGE_KEYS))}; missing {missing}')
        pixels, mask, shapes = (image.data[key] for key in IMAGE_KEYS[:3])
        grid = image.data['tile_grid']
        tiles = pixels.shape[0]
        if tuple(grid.shape) != (1, 2) or pixels.dim() != 3 or pixels.shape[2] != self.patch_features or \
                tuple(mask.shape) != tuple(pixels.shape[:2]) or tuple(shapes.shape) != (tiles, 2):
            raise ValueError(f"an LFM2-VL image's 'pixel_values' [tiles, patches, {self.patch_features}], "
                             f"'pixel_attention_mask' [tiles, patches], 'spatial_shapes' [tiles, 2] and 'tile_grid' "
                             f'[[rows, columns]] do not fit together: '
                             f'{[list(image.data[key].shape) for key in IMAGE_KEYS]}')
        rows, cols = (int(n) for n in grid[0])
        thumbnail = tiles - rows * cols
        if rows < 1 or cols < 1 or thumbnail not in ((0, 1) if rows * cols > 1 else (0, )):
            raise ValueError(f'an LFM2-VL image of {rows} x {cols} tiles has {tiles} tiles of pixels')
        grids = [(int(h), int(w)) for h, w in shapes]
        for (h, w), valid in zip(grids, mask.sum(dim=1).tolist()):
            if h < 1 or w < 1 or h % self.factor or w % self.factor or h * w != valid:
                raise ValueError(f'an LFM2-VL tile of {h} x {w} patches needs both sides in multiples of '
                                 f'{self.factor} and as many unmasked patches, got {valid}')
        return grids, rows * cols, thumbnail

    def placeholder_mask(self, image: MultiModalInput) -> list[bool]:
        """The ``<image>`` tokens of the span (checked against the image's tiles)."""
        grids, grid_tiles, thumbnail = self._tiles(image)
        tokens = [[True] * (h // self.factor) * (w // self.factor) for h, w in grids]
        if grid_tiles == 1:
            mask = [False] + tokens[0] + [False]
        else:  # a marker before each tile's tokens, the thumbnail's included
            mask = [False] + [flag for tile in tokens for flag in [False] + tile] + [False]
        if len(mask) != image.length:
            raise ValueError(f'an LFM2-VL image of {len(grids)} tiles spans {len(mask)} tokens, not {image.length}')
        return mask

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        """Features laid out as the images' spans: one row per span token, zeros where no ``<image>`` is."""
        device = self.embed_tokens.weight.device
        spans = []
        for image in inputs:
            mask = self.placeholder_mask(image)
            hidden = self.vision_tower(
                pixel_values=image.data['pixel_values'].to(device, self.embed_tokens.weight.dtype),
                spatial_shapes=image.data['spatial_shapes'].to(device),
                pixel_attention_mask=image.data['pixel_attention_mask'].to(device)).last_hidden_state
            features = [self.multi_modal_projector(tile[:h * w].view(1, h, w, -1)).flatten(0, 2)
                        for tile, (h, w) in zip(hidden, image.data['spatial_shapes'].tolist())]
            features = torch.cat(features)
            span = features.new_zeros(image.length, features.shape[-1])
            span[torch.tensor(mask, device=device)] = features
            spans.append(span)
        return torch.cat(spans)
