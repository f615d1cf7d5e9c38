"""What the engine knows about the images of a prompt, and which of them one step encodes."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MultiModalInput:
    """One image of a prompt: its placeholder tokens are ``prompt_ids[offset:offset + length]``.

    ``data`` holds what the model's vision encoder takes for this image alone (``pixel_values``, and
    ``image_grid_thw`` for Qwen-VL); ``content_hash`` identifies the picture in the prefix cache.
    """

    offset: int
    length: int
    content_hash: str
    data: dict[str, torch.Tensor]

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultiModalBatch:
    """The images a step encodes, batched: row ``feature_rows[i]`` of their concatenated features
    becomes the embedding of packed input token ``token_rows[i]``."""

    inputs: list[MultiModalInput]
    token_rows: torch.Tensor
    feature_rows: torch.Tensor
