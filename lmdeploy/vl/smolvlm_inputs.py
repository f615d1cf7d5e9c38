"""SmolVLM's and Idefics3's image preprocessing: their transformers image processor (the image resized, cut into
tiles of ``max_image_size`` plus a global tile) and the text transformers' processor writes for each image."""
from __future__ import annotations

from functools import lru_cache

import torch
from PIL import Image
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from lmdeploy.vl.image_inputs import ImageInputs


class SmolVLMImageInputs(ImageInputs):
    """SmolVLM and Idefics3: an image's span is the text of ``get_image_prompt_string`` (the function both
    processors write it with) for its tiles, tokenized; its ``<image>`` tokens take the tiles' features in order, the
    global tile's last."""

    def __init__(self, model_dir: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase):
        from lmdeploy.pytorch.models.smolvlm_vl import tokens_per_tile
        super().__init__(model_dir, config, tokenizer)
        self.tokenizer = tokenizer
        self.tokens_per_tile = tokens_per_tile(config)
        # the names SmolVLM's processor reads from the tokenizer (Idefics3's are these defaults)
        self.markers = {'fake_token_around_image': getattr(tokenizer, 'fake_image_token', '<fake_token_around_image>'),
                        'image_token': tokenizer.convert_ids_to_tokens(self.image_token_id),
                        'global_image_token': getattr(tokenizer, 'global_image_token', '<global-img>')}
        unknown = [token for token in self.markers.values()
                   if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id)]
        if unknown:
            raise ValueError(f'{model_dir}: the tokenizer lacks the image tokens {unknown}')
        self.span = lru_cache(maxsize=64)(self._span)

    def __call__(self, image: Image.Image) -> tuple[int, dict[str, torch.Tensor]]:
        out = self.image_processor(images=[image], return_row_col_info=True, return_tensors='np')
        rows, cols = int(out['rows'][0][0]), int(out['cols'][0][0])
        ids = self.span(rows, cols)
        return len(ids), {'pixel_values': torch.from_numpy(out['pixel_values'][0]),
                          'image_grid': torch.tensor([[rows, cols]]),
                          'placeholder_mask': torch.tensor([token == self.image_token_id for token in ids])}

    def placeholder_ids(self, length: int, data: dict[str, torch.Tensor]) -> list[int]:
        return self.span(*(int(n) for n in data['image_grid'][0]))

    def least_tokens(self, size: tuple[int, int] | None) -> int:
        if size is None:
            return 1
        width, height = size
        _, rows, cols = self.image_processor.get_number_of_image_patches(height, width)
        return (rows * cols + 1) * self.tokens_per_tile

    def _span(self, rows: int, cols: int) -> list[int]:
        """The tokens of an image cut into ``rows`` x ``cols`` tiles (0 x 0: one tile, no global one)."""
        text = get_image_prompt_string(rows, cols, self.tokens_per_tile, **self.markers)
        return self.tokenizer.encode(text, add_special_tokens=False)
