"""LFM2-VL's image preprocessing: the pixels of transformers' ``Lfm2VlImageProcessor`` (a torchvision-only image
processor: this computes them in numpy) and the span transformers' ``Lfm2VlProcessor`` writes for each image.

An image whose pixels (rounded to whole merged patches) pass ``max_image_tokens`` merged patches times
``max_pixels_tolerance`` is cut into a grid of ``tile_size`` tiles (the grid of ``min_tiles`` to ``max_tiles`` tiles
whose aspect ratio is closest to the image's) plus, with ``use_thumbnail``, the whole image smart-resized; any other
image is smart-resized alone: both sides in multiples of ``encoder_patch_size * downsample_factor``, between
``min_image_tokens`` and ``max_image_tokens`` merged patches. Resizes are torchvision's antialiased uint8 ones
(``resize_uint8``); each tile is normalized, cut into ``encoder_patch_size`` patches and padded to the most patches
a tile can have.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.image_processing_utils import ImageProcessingMixin
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling
from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

from lmdeploy.vl.image_inputs import ImageInputs

# Lfm2VlImageProcessor's defaults, which preprocessor_config.json overrides
DEFAULTS = dict(downsample_factor=2, do_image_splitting=True, min_tiles=2, max_tiles=10, use_thumbnail=True,
                min_image_tokens=64, max_image_tokens=256, encoder_patch_size=16, tile_size=512,
                max_pixels_tolerance=2.0, resample=PILImageResampling.BILINEAR, rescale_factor=1 / 255,
                image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD, do_rescale=True,
                do_normalize=True, do_pad=True)
# settings this preprocessing does not follow, with the value it needs
REQUIRED = dict(do_rescale=True, do_normalize=True, do_pad=True)


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def closest_grid(width: int, height: int, min_tiles: int, max_tiles: int, tile_size: int) -> tuple[int, int]:
    """The (columns, rows) of ``min_tiles`` to ``max_tiles`` tiles whose aspect ratio is closest to the image's; of
    equally close ones the later (more tiles) where the image covers over half of its area."""
    ratios = sorted({(w, h) for n in range(min_tiles, max_tiles + 1) for w in range(1, n + 1)
                     for h in range(1, n + 1) if min_tiles <= w * h <= max_tiles}, key=lambda r: r[0] * r[1])
    aspect, best, best_diff = width / height, (1, 1), float('inf')
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * tile_size * tile_size * ratio[0] * ratio[1]:
            best = ratio
    return best


class Lfm2VlImageInputs(ImageInputs):
    """LFM2-VL (see the module's docstring): an image's tensors are its tiles' ``pixel_values`` [tiles, patches,
    3 * patch**2], ``pixel_attention_mask`` [tiles, patches], ``spatial_shapes`` [tiles, 2] (patch rows and
    columns) and ``tile_grid`` [[rows, columns]]."""

    def __init__(self, model_dir: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase):
        from lmdeploy.vl.resize import FILTERS
        self.config = config
        try:
            settings, _ = ImageProcessingMixin.get_image_processor_dict(model_dir)
        except OSError:
            settings = {}
        self.settings = SimpleNamespace(**{key: settings.get(key, value) for key, value in DEFAULTS.items()})
        s = self.settings
        wrong = {key: getattr(s, key) for key, value in REQUIRED.items() if getattr(s, key) != value}
        if wrong:
            raise ValueError(f'{model_dir}: LFM2-VL images with {wrong} are not supported')
        s.resample = PILImageResampling(s.resample)
        if s.resample not in FILTERS:
            raise ValueError(f'{model_dir}: LFM2-VL images resized with {s.resample.name} are not supported')
        if not s.do_image_splitting:
            s.min_tiles = s.max_tiles = 1
        if s.encoder_patch_size != config.vision_config.patch_size or \
                s.downsample_factor != config.downsample_factor:
            raise ValueError(f'{model_dir}: the image processor cuts patches of {s.encoder_patch_size} merged by '
                             f'{s.downsample_factor}, the model takes {config.vision_config.patch_size} merged by '
                             f'{config.downsample_factor}')
        self.max_patches = max(s.max_image_tokens * s.downsample_factor**2,
                               (s.tile_size // s.encoder_patch_size)**2 if s.do_image_splitting else 0)
        # the torchvision backend's normalization: mean and std scaled by 1 / rescale_factor in float32, then
        # (pixel - mean) / std
        scale = np.float32(1.0 / s.rescale_factor)
        self.mean, self.std = (np.asarray(values, np.float32) * scale for values in (s.image_mean, s.image_std))
        # the processor's names of the image tokens, as Lfm2VlProcessor reads them from the tokenizer
        self.names = SimpleNamespace(
            image_token=getattr(tokenizer, 'image_token', '<image>'),
            image_start_token=getattr(tokenizer, 'image_start_token', '<|image_start|>'),
            image_end_token=getattr(tokenizer, 'image_end_token', '<|image_end|>'),
            image_thumbnail_token=getattr(tokenizer, 'image_thumbnail_token', '<|img_thumbnail|>'))
        self.tokenizer = tokenizer
        self.image_token_id = config.image_token_id
        if tokenizer.convert_tokens_to_ids(self.names.image_token) != self.image_token_id:
            raise ValueError(f'{model_dir}: the tokenizer\'s {self.names.image_token} is not the config\'s '
                             f'image_token_id {self.image_token_id}')
        self._spans: dict[tuple[int, ...], list[int]] = {}

    def _layout(self, height: int, width: int) -> tuple[int, int, int, int]:
        """Rows and columns of tiles (1 x 1: not cut) and the height and width of the smart-resized image."""
        s = self.settings
        factor = s.encoder_patch_size * s.downsample_factor
        max_pixels = s.max_image_tokens * factor**2
        min_pixels = s.min_image_tokens * factor**2
        h_bar = max(factor, round_by_factor(height, factor))
        w_bar = max(factor, round_by_factor(width, factor))
        large = max(s.encoder_patch_size, round_by_factor(height, factor)) * \
            max(s.encoder_patch_size, round_by_factor(width, factor)) > max_pixels * s.max_pixels_tolerance
        if h_bar * w_bar > max_pixels:
            beta = math.sqrt(height * width / max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < min_pixels:
            beta = math.sqrt(min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        rows = cols = 1
        if large and not s.min_tiles == s.max_tiles == 1:
            cols, rows = closest_grid(width, height, s.min_tiles, s.max_tiles, s.tile_size)
        return rows, cols, h_bar, w_bar

    def _tokens(self, height: int, width: int) -> int:
        """Merged patches of an image of ``height x width`` pixels (as ``Lfm2VlProcessor`` counts them)."""
        return Lfm2VlProcessor._compute_tokens_for_image(None, [height, width], self.settings.encoder_patch_size,
                                                         self.settings.downsample_factor)

    def _span(self, rows: int, cols: int, height: int, width: int) -> list[int]:
        """The tokens of an image cut into ``rows x cols`` tiles whose thumbnail (or whole) is ``height x width``:
        ``Lfm2VlProcessor``'s text for it, tokenized."""
        s = self.settings
        key = (rows, cols, height, width)
        if key not in self._spans:
            text = Lfm2VlProcessor._build_image_tokens(self.names, rows, cols, self._tokens(s.tile_size, s.tile_size),
                                                       self._tokens(height, width), s.use_thumbnail, True)
            self._spans[key] = self.tokenizer.encode(text, add_special_tokens=False)
        return self._spans[key]

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        from lmdeploy.vl.resize import resize_uint8
        s = self.settings
        pixels = np.asarray(image.convert('RGB'))
        rows, cols, height, width = self._layout(*pixels.shape[:2])
        if rows * cols > 1:
            tile = s.tile_size
            grid = resize_uint8(pixels, rows * tile, cols * tile, s.resample)
            tiles = [grid[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
            if s.use_thumbnail:
                tiles.append(resize_uint8(pixels, height, width, s.resample))
        else:
            tiles = [resize_uint8(pixels, height, width, s.resample)]
        patch = s.encoder_patch_size
        values = np.zeros((len(tiles), self.max_patches, 3 * patch * patch), np.float32)
        mask = np.zeros((len(tiles), self.max_patches), np.int32)
        shapes = np.zeros((len(tiles), 2), np.int64)
        for index, tile_pixels in enumerate(tiles):
            h, w = tile_pixels.shape[0] // patch, tile_pixels.shape[1] // patch
            normalized = (tile_pixels.astype(np.float32) - self.mean) / self.std  # [H, W, 3]
            patches = normalized.reshape(h, patch, w, patch, 3).transpose(0, 2, 1, 3, 4).reshape(h * w, -1)
            values[index, :h * w] = patches
            mask[index, :h * w] = 1
            shapes[index] = h, w
        ids = self._span(rows, cols, height, width)
        return len(ids), {'pixel_values': torch.from_numpy(values), 'pixel_attention_mask': torch.from_numpy(mask),
                          'spatial_shapes': torch.from_numpy(shapes), 'tile_grid': torch.tensor([[rows, cols]])}

    def placeholder_ids(self, length: int, data: dict[str, torch.Tensor]) -> list[int]:
        rows, cols = (int(n) for n in data['tile_grid'][0])
        patch = self.settings.encoder_patch_size
        height, width = (int(n) * patch for n in data['spatial_shapes'][-1])
        return self._span(rows, cols, height, width)

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        if size is None:
            return 1
        width, height = size
        rows, cols, h, w = self._layout(height, width)
        return len(self._span(rows, cols, h, w))
