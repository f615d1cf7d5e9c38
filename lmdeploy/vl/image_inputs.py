"""Per-family image preprocessing: the model's own transformers image processor, and how many
placeholder tokens each image's features fill.

The processors return numpy arrays that ``torch.from_numpy`` wraps without copying: a torch copy on
the preprocessing thread would start an OpenMP team there and slow the engine's thread down.
"""
from __future__ import annotations

import importlib

import numpy as np
import torch
from PIL import Image
from transformers import PretrainedConfig, PreTrainedTokenizerBase


LLAMA4_IMAGE_TOKENS = ['<|image|>', '<|image_start|>', '<|image_end|>', '<|tile_x_separator|>', '<|tile_y_separator|>']


# Families whose preprocessing lives in a module of its own (which imports this one), imported when served: their
# transformers processors take seconds to import.
OWN_MODULES = {'smolvlm': 'smolvlm_inputs:SmolVLMImageInputs', 'idefics3': 'smolvlm_inputs:SmolVLMImageInputs',
               'lfm2_vl': 'lfm2_vl_inputs:Lfm2VlImageInputs'}


def _own_module(name: str) -> type:
    module, cls = name.split(':')
    return getattr(importlib.import_module(f'lmdeploy.vl.{module}'), cls)


class ImageInputs:
    """Turns one image into ``(number of placeholder tokens, tensors for the vision encoder)``.

    ``span_ids`` are the tokens the prompt holds before and after each image's run of placeholders
    (InternVL's ``<img>`` and ``</img>``); most families put them in the chat template instead.
    """

    span_ids: tuple[list[int], list[int]] = ([], [])
    # the text of an image for a chat template that takes only string contents; None: no such template
    placeholder_text: str | None = None

    def __init__(self, model_dir: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase):
        from transformers import AutoImageProcessor  # heavy: only vision-language models need it

        from lmdeploy.vl.resize import with_torchvision_resize
        self.config = config
        self.image_token_id: int = config.image_token_id
        # the PIL backend, with the resize of the torchvision backend that transformers users mostly run
        self.image_processor = with_torchvision_resize(AutoImageProcessor.from_pretrained(model_dir, backend='pil'))

    @classmethod
    def for_model(cls, model_dir: str, config: PretrainedConfig,
                  tokenizer: PreTrainedTokenizerBase) -> ImageInputs | None:
        """The preprocessing of a vision-language model's family; None for text-only models."""
        family = {'qwen2_vl': QwenVLImageInputs, 'qwen2_5_vl': QwenVLImageInputs, 'qwen3_vl': QwenVLImageInputs,
                  'qwen3_vl_moe': QwenVLImageInputs, 'qwen3_5': QwenVLImageInputs, 'qwen3_5_moe': QwenVLImageInputs,
                  'llava': LlavaImageInputs, 'internvl': InternVLImageInputs,
                  'mistral3': Mistral3ImageInputs, 'gemma3': Gemma3ImageInputs,
                  'llama4': Llama4ImageInputs,
                  'glm4v': QwenVLImageInputs, 'glm4v_moe': QwenVLImageInputs, 'glm46v': QwenVLImageInputs}
        own_module = OWN_MODULES.get(config.model_type)
        kind = _own_module(own_module) if own_module else family.get(config.model_type)
        return kind(model_dir, config, tokenizer) if kind else None

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def placeholder_ids(self, length: int, data: dict[str, torch.Tensor]) -> list[int]:
        """The ``length`` tokens of an image's span in the prompt: its placeholder each time."""
        return [self.image_token_id] * length

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        """The fewest placeholder tokens (``placeholder_ids``) an image of ``size`` (width, height; None: any) fills,
        known without preprocessing it: 1 here; the families count it from the size where that fixes it."""
        return 1

    def expand_text(self, text: str) -> str:
        """The rendered prompt as the family's processor rewrites it before tokenizing: unchanged for most."""
        return text


class QwenVLImageInputs(ImageInputs):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and GLM-4.1V / 4.5V / 4.6V: dynamic resolution; one token per merged
    ``merge x merge`` patch group."""

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        out = self.image_processor(images=[image], return_tensors='np')
        grid = torch.from_numpy(out['image_grid_thw'])
        merge = self.config.vision_config.spatial_merge_size
        return int(grid.prod()) // merge**2, {'pixel_values': torch.from_numpy(out['pixel_values']), 'image_grid_thw': grid}

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        if size is None:
            return 1
        width, height = size
        patches = self.image_processor.get_number_of_image_patches(height, width)
        return patches // self.config.vision_config.spatial_merge_size**2


class LlavaImageInputs(ImageInputs):
    """LLaVA: a fixed-size crop; one token per vision patch (plus CLS with the 'full' strategy)."""

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = torch.from_numpy(self.image_processor(images=[image], return_tensors='np')['pixel_values'])
        return self._tokens(pixels.shape[-2], pixels.shape[-1]), {'pixel_values': pixels}

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        crop = getattr(self.image_processor, 'crop_size', None)  # every image's pixels, where the processor crops
        return self._tokens(crop.height, crop.width) if crop and self.image_processor.do_center_crop else 1

    def _tokens(self, height: int, width: int) -> int:
        patch = self.config.vision_config.patch_size
        return (height // patch) * (width // patch) + int(self.config.vision_feature_select_strategy == 'full')


class InternVLImageInputs(ImageInputs):
    """InternVL: the image cut into up to ``max_patches`` tiles of the tower's size plus a thumbnail of it
    (the image processor's ``crop_to_patches``, which InternVL's processor turns on); each tile gives
    ``(size / patch)**2 * downsample_ratio**2`` tokens, and the run of them sits between ``<img>`` and
    ``</img>``."""

    def __init__(self, model_dir: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase):
        super().__init__(model_dir, config, tokenizer)
        vision = config.vision_config
        patches = (vision.image_size[0] // vision.patch_size[0]) * (vision.image_size[1] // vision.patch_size[1])
        self.tokens_per_tile = int(patches * config.downsample_ratio**2)
        # named in InternVL's tokenizer config (extra_special_tokens); these are the names it gives them
        self.span_ids = ([tokenizer.convert_tokens_to_ids(getattr(tokenizer, 'start_image_token', '<img>'))],
                         [tokenizer.convert_tokens_to_ids(getattr(tokenizer, 'end_image_token', '</img>'))])
        # the remote-code checkpoints' template (kept in llama.cpp's files) takes strings: an image is its line
        self.placeholder_text = tokenizer.convert_ids_to_tokens(self.image_token_id) + '\n'

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = self.image_processor(images=[image], crop_to_patches=True, return_tensors='np')['pixel_values']
        return len(pixels) * self.tokens_per_tile, {'pixel_values': torch.from_numpy(pixels)}

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        if size is None:
            return 1
        width, height = size
        tiles = self.image_processor.get_number_of_image_patches(height, width, {'crop_to_patches': True})
        return tiles * self.tokens_per_tile


class Mistral3ImageInputs(ImageInputs):
    """Mistral 3 (Pixtral's image processor): the image resized to fit ``longest_edge`` in whole merged patches
    of ``patch_size * spatial_merge_size`` pixels; its span is a row of ``[IMG]`` per row of merged patches, each
    row closed by ``[IMG_BREAK]`` and the last by ``[IMG_END]``, as transformers' ``PixtralProcessor`` lays it out.
    """

    def __init__(self, model_dir: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase):
        super().__init__(model_dir, config, tokenizer)
        self.merged_patch = config.vision_config.patch_size * config.spatial_merge_size
        self.break_id, self.end_id = tokenizer.convert_tokens_to_ids(['[IMG_BREAK]', '[IMG_END]'])

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        patch = {'height': self.merged_patch, 'width': self.merged_patch}
        out = self.image_processor(images=[image], patch_size=patch, return_tensors='np')
        rows, cols = (int(side) // self.merged_patch for side in out['image_sizes'][0])
        return rows * (cols + 1), {'pixel_values': torch.from_numpy(out['pixel_values']),
                                   'image_sizes': torch.from_numpy(out['image_sizes'])}

    def placeholder_ids(self, length: int, data: dict[str, torch.Tensor]) -> list[int]:
        rows, cols = (int(side) // self.merged_patch for side in data['image_sizes'][0])
        ids = ([self.image_token_id] * cols + [self.break_id]) * rows
        ids[-1] = self.end_id
        return ids

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        from transformers.image_utils import ChannelDimension
        from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size
        if size is None or not self.image_processor.do_resize:
            return 1
        width, height = size
        bounds = self.image_processor.size
        longest = (bounds.longest_edge, ) * 2 if bounds.longest_edge else (bounds.height, bounds.width)
        # the function reads only the shape of the image it is given: a view of one byte stands for the pixels
        rows, cols = (side // self.merged_patch for side in get_resize_output_image_size(
            np.broadcast_to(np.uint8(0), (height, width, 3)), size=longest, patch_size=self.merged_patch,
            input_data_format=ChannelDimension.LAST))
        return rows * (cols + 1)


class Gemma3ImageInputs(ImageInputs):
    """Gemma 3: one image of the tower's size (pan-and-scan off, as transformers' processor defaults), pooled to
    ``mm_tokens_per_image`` tokens. Like transformers' processor, each ``<start_of_image>`` that the chat template
    writes becomes ``\\n\\n<start_of_image>``, the image's tokens, then ``<end_of_image>\\n\\n``."""

    def __init__(self, model_dir: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase):
        super().__init__(model_dir, config, tokenizer)
        boi, image, eoi = tokenizer.convert_ids_to_tokens([config.boi_token_id, self.image_token_id,
                                                           config.eoi_token_id])
        self.image_marker = boi
        self.expanded_marker = f'\n\n{boi}{image}{eoi}\n\n'

    def expand_text(self, text: str) -> str:
        return text.replace(self.image_marker, self.expanded_marker)

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = self.image_processor(images=[image], do_pan_and_scan=False, return_tensors='np')['pixel_values']
        return self.config.mm_tokens_per_image, {'pixel_values': torch.from_numpy(pixels)}

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        return self.config.mm_tokens_per_image


class Llama4ImageInputs(ImageInputs):
    """Llama 4: the image resized without distortion onto the canvas of up to ``max_patches`` tiles that scales it
    least, padded and cut into tiles, plus (when there are several) a global tile of the whole image squeezed to one
    tile; each tile gives ``(tile / patch)**2 * pixel_shuffle_ratio**2`` tokens. The chat template's ``<|image|>``
    becomes the image's span as transformers' ``Llama4Processor`` writes it: ``<|image_start|>``, each tile's
    ``<|patch|>`` tokens (``<|tile_x_separator|>`` between the tiles of a row, ``<|tile_y_separator|>`` after
    each row), ``<|image|>``, the global tile's ``<|patch|>`` tokens, ``<|image_end|>``.

    transformers' ``Llama4ImageProcessor`` needs torchvision; this computes its pixels in numpy: Mllama's canvas
    and size functions (Meta's algorithm in both), torchvision's uint8 resize (``resize_uint8``), and the rescale
    and normalization rounded to bfloat16 after each step, as that processor computes them.
    """

    def __init__(self, model_dir: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase):
        from transformers.image_processing_utils import ImageProcessingMixin
        from transformers.image_utils import PILImageResampling

        from lmdeploy.vl.resize import FILTERS, round_to_bfloat16
        self.config = config
        try:
            settings, _ = ImageProcessingMixin.get_image_processor_dict(model_dir)
        except OSError:  # a checkpoint of the language model alone: images are refused by the model
            settings = {}
        if settings.get('resize_to_max_canvas'):
            raise ValueError(f'{model_dir}: Llama 4 images with resize_to_max_canvas are not supported')
        size = settings.get('size', {'height': 336, 'width': 336})
        if size['height'] != size['width']:
            raise ValueError(f'{model_dir}: Llama 4 tiles must be square, got {size}')
        self.tile, self.max_tiles = size['height'], settings.get('max_patches', 16)
        self.resample = PILImageResampling(settings.get('resample', PILImageResampling.BILINEAR))
        if self.resample not in FILTERS:
            raise ValueError(f'{model_dir}: Llama 4 images resized with {self.resample.name} are not supported')
        # the processor rescales and normalizes in bfloat16, rounding after each step: per channel, the value of
        # each uint8 level (kept in float32)
        mean, std = (round_to_bfloat16(np.array(settings.get(key, [0.5] * 3), np.float32)[:, None])
                     for key in ('image_mean', 'image_std'))
        levels = np.arange(256, dtype=np.float32)[None] * np.float32(settings.get('rescale_factor', 1 / 255))
        self.level_values = round_to_bfloat16(round_to_bfloat16(round_to_bfloat16(levels) - mean) / std)
        vision = config.vision_config
        self.tokens_per_tile = int((self.tile // vision.patch_size)**2 * vision.pixel_shuffle_ratio**2)
        ids = dict(zip(LLAMA4_IMAGE_TOKENS, tokenizer.convert_tokens_to_ids(LLAMA4_IMAGE_TOKENS)))
        unknown = [token for token, id_ in ids.items() if id_ is None or id_ == tokenizer.unk_token_id]
        if unknown:
            raise ValueError(f'{model_dir}: the tokenizer lacks the Llama 4 image tokens {unknown}')
        self.image_token_id = ids['<|image|>']
        self.start_id, self.end_id = ids['<|image_start|>'], ids['<|image_end|>']
        self.tile_x_id, self.tile_y_id = ids['<|tile_x_separator|>'], ids['<|tile_y_separator|>']
        self.patch_id = config.image_token_id

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        from transformers.models.mllama.image_processing_pil_mllama import (get_image_size_fit_to_canvas,
                                                                            get_optimal_tiled_canvas)

        from lmdeploy.vl.resize import resize_uint8
        pixels = np.asarray(image)
        height, width = pixels.shape[:2]
        canvas_height, canvas_width = get_optimal_tiled_canvas(height, width, self.max_tiles, self.tile)
        new_height, new_width = get_image_size_fit_to_canvas(height, width, canvas_height, canvas_width, self.tile)
        canvas = np.zeros((canvas_height, canvas_width, 3), np.uint8)
        canvas[:new_height, :new_width] = resize_uint8(pixels, new_height, new_width, self.resample)
        rows, cols = canvas_height // self.tile, canvas_width // self.tile
        tiles = canvas.reshape(rows, self.tile, cols, self.tile, 3).transpose(0, 2, 4, 1, 3)
        tiles = tiles.reshape(rows * cols, 3, self.tile, self.tile)
        if rows * cols > 1:
            whole = resize_uint8(pixels, self.tile, self.tile, self.resample).transpose(2, 0, 1)
            tiles = np.concatenate([tiles, whole[None]])
        return len(self._span(rows, cols)), {
            'pixel_values': torch.from_numpy(self.level_values[np.arange(3)[:, None, None], tiles]),
            'aspect_ratios': torch.tensor([[rows, cols]])}

    def placeholder_ids(self, length: int, data: dict[str, torch.Tensor]) -> list[int]:
        return self._span(*(int(n) for n in data['aspect_ratios'][0]))

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        from transformers.models.mllama.image_processing_pil_mllama import get_optimal_tiled_canvas
        if size is None:
            return 1
        width, height = size
        canvas_height, canvas_width = get_optimal_tiled_canvas(height, width, self.max_tiles, self.tile)
        return len(self._span(canvas_height // self.tile, canvas_width // self.tile))

    def _span(self, rows: int, cols: int) -> list[int]:
        """The tokens of an image cut into ``rows`` x ``cols`` tiles."""
        tile = [self.patch_id] * self.tokens_per_tile
        ids = [self.start_id]
        if rows * cols > 1:
            row = (tile + [self.tile_x_id]) * cols
            ids += (row[:-1] + [self.tile_y_id]) * rows
        return ids + [self.image_token_id] + tile + [self.end_id]
