"""Llama 4 with images (``Llama4ForConditionalGeneration``: Llama-4-Scout / Maverick): the Llama 4 text model fed by
Llama 4's vision tower through a linear projector.

Each tile (``vision_config.image_size`` pixels square) is cut into patches that one linear layer embeds (an unfold,
no convolution); a class token joins them, learned positions are added, and the encoder layers (LayerNorm, attention
with a 2-D rotary on each patch's column and row, GELU MLP) run over the tile. The class token is dropped, every
``1 / pixel_shuffle_ratio`` square of patches is shuffled into one token, a GELU MLP (the vision adapter) and the
projector map it into the language model. The features replace the ``<|patch|>`` tokens of the image's span; its
separators and ``<|image|>`` keep their own embeddings.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import WeightKey
from lmdeploy.pytorch.models.llama4 import Llama4ForCausalLM
from lmdeploy.pytorch.models.vision_language import VisionLanguageModel, pixel_shuffle
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.pytorch.nn.rotary import apply_rope
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

VISION_WEIGHTS = ('vision_model.', 'multi_modal_projector.')


def patch_rotary_angles(vision: PretrainedConfig) -> torch.Tensor:
    """fp32 ``[patches + 1, head_dim / 2]`` angles of each rotating pair of a head's features: the first half of the
    pairs turn with the patch's column + 1, the second half with its row + 1, each at the rope frequencies of a
    quarter of the head; the class token (last) does not turn."""
    side = vision.image_size // vision.patch_size
    quarter = vision.hidden_size // vision.num_attention_heads // 4
    freqs = 1.0 / (vision.rope_parameters['rope_theta'] ** (torch.arange(quarter).float() / quarter))
    index = torch.arange(side * side)
    cols, rows = (index % side + 1).float(), (index // side + 1).float()
    angles = torch.cat([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1)
    return torch.cat([angles, angles.new_zeros(1, angles.shape[1])])


class Llama4VisionAttention(nn.Module):
    """Full attention within a tile, queries and keys turned in neighbouring pairs by :func:`patch_rotary_angles`."""

    def __init__(self, vision: PretrainedConfig):
        super().__init__()
        hidden = vision.hidden_size
        self.num_heads = vision.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tiles, tokens, hidden = x.shape
        q, k = (apply_rope(proj(x).view(tiles * tokens, self.num_heads, self.head_dim), cos, sin, interleaved=True)
                for proj in (self.q_proj, self.k_proj))
        v = self.v_proj(x).view(tiles * tokens, self.num_heads, self.head_dim)
        q, k, v = (t.view(tiles, tokens, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(tiles, tokens, hidden))


class Llama4VisionMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``; the vision adapter's (no biases) applies GELU to its output too."""

    def __init__(self, sizes: tuple[int, int, int], bias: bool = True, gelu_output: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(sizes[0], sizes[1], bias=bias)
        self.fc2 = nn.Linear(sizes[1], sizes[2], bias=bias)
        self.gelu_output = gelu_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(F.gelu(self.fc1(x)))
        return F.gelu(x) if self.gelu_output else x


class Llama4VisionEncoderLayer(nn.Module):
    """Pre-LayerNorm attention and MLP, each added to its input."""

    def __init__(self, vision: PretrainedConfig):
        super().__init__()
        hidden = vision.hidden_size
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = Llama4VisionAttention(vision)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = Llama4VisionMLP((hidden, vision.intermediate_size, hidden))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4VisionEncoder(nn.Module):
    """The encoder layers (``vision_model.model.layers``); :class:`Llama4VisionModel` runs them."""

    def __init__(self, vision: PretrainedConfig):
        super().__init__()
        self.layers = nn.ModuleList(Llama4VisionEncoderLayer(vision) for _ in range(vision.num_hidden_layers))


class Llama4PatchEmbedding(nn.Module):
    """Each ``patch x patch`` square of a tile's pixels, flattened channel-major, through one linear layer."""

    def __init__(self, vision: PretrainedConfig):
        super().__init__()
        self.patch_size = vision.patch_size
        self.linear = nn.Linear(vision.num_channels * self.patch_size**2, vision.hidden_size, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.linear(F.unfold(pixels, self.patch_size, stride=self.patch_size).transpose(1, 2))


class Llama4VisionAdapter(nn.Module):
    """The pixel shuffle, then the adapter MLP (``fc1``, GELU, ``fc2``, GELU)."""

    def __init__(self, vision: PretrainedConfig):
        super().__init__()
        self.pixel_shuffle_ratio = vision.pixel_shuffle_ratio
        self.mlp = Llama4VisionMLP((vision.intermediate_size, vision.projector_input_dim,
                                    vision.projector_output_dim), bias=False, gelu_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(x, self.pixel_shuffle_ratio))


class Llama4VisionModel(nn.Module):
    """Tiles ``[N, C, size, size]`` to features ``[N, tokens per tile, projector_output_dim]``."""

    def __init__(self, vision: PretrainedConfig):
        super().__init__()
        hidden = vision.hidden_size
        num_patches = (vision.image_size // vision.patch_size)**2
        if vision.intermediate_size != hidden / vision.pixel_shuffle_ratio**2:
            raise ValueError(f'the Llama 4 vision adapter takes the pixel-shuffled features: intermediate_size must '
                             f'be hidden_size / pixel_shuffle_ratio**2 = {hidden / vision.pixel_shuffle_ratio**2}, '
                             f'got {vision.intermediate_size}')
        self.patch_embedding = Llama4PatchEmbedding(vision)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(num_patches + 1, hidden))
        self.layernorm_pre = nn.LayerNorm(hidden)
        self.model = Llama4VisionEncoder(vision)
        self.layernorm_post = nn.LayerNorm(hidden)
        self.vision_adapter = Llama4VisionAdapter(vision)
        # a plain attribute, not a buffer: casting the model to bf16 must not round the angles
        self.rotary_angles = patch_rotary_angles(vision)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)
        x = torch.cat([x, self.class_embedding.expand(x.shape[0], 1, -1)], dim=1) + self.positional_embedding_vlm
        x = self.layernorm_pre(x)
        angles = self.rotary_angles.to(x.device).repeat(x.shape[0], 1)
        cos, sin = (torch.cat([t, t], dim=-1).to(x.dtype) for t in (angles.cos(), angles.sin()))
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.vision_adapter(self.layernorm_post(x)[:, :-1])


class Llama4MultiModalProjector(nn.Module):
    """The adapter's features into the language model's width."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.linear_1 = nn.Linear(config.vision_config.vision_output_dim, config.text_config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)


class Llama4ForConditionalGeneration(VisionLanguageModel, Llama4ForCausalLM):
    """Llama 4's text decoder with its vision tower; a prompt without images runs the text decoder alone. A
    checkpoint without ``vision_model.*`` and ``multi_modal_projector.*`` tensors (the language model alone) loads
    without the tower and refuses images."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        mm = cfg.mm_config
        self.vision_model = Llama4VisionModel(mm.vision_config)
        self.multi_modal_projector = Llama4MultiModalProjector(mm)
        self.image_token_id = mm.image_token_id
        vision = mm.vision_config
        self.tile_shape = (vision.num_channels, vision.image_size, vision.image_size)
        self.tokens_per_tile = int((vision.image_size // vision.patch_size)**2 * vision.pixel_shuffle_ratio**2)
        self.has_vision_weights = True
        self.requires_grad_(False)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Loads the checkpoint; without vision tensors, drops the tower and the projector afterwards."""
        self.has_vision_weights = False
        super().load_weights(self._noting_vision_weights(weights))
        if not self.has_vision_weights:
            self.vision_model = self.multi_modal_projector = None

    def _noting_vision_weights(self, weights: Iterable[tuple[str, WeightSource]]
                               ) -> Iterator[tuple[str, WeightSource]]:
        for name, tensor in weights:
            self.has_vision_weights |= name.removeprefix('model.').startswith(VISION_WEIGHTS)
            yield name, tensor

    def required_weights(self) -> set[WeightKey]:
        required = super().required_weights()
        if self.has_vision_weights:
            return required
        return {key for key in required if not (key if isinstance(key, str) else key[0]).startswith(VISION_WEIGHTS)}

    def placeholder_mask(self, image: MultiModalInput) -> list[bool]:
        """The ``<|patch|>`` tokens of the image's span (the span checked against its tile layout)."""
        if self.vision_model is None:
            raise ValueError('this Llama 4 checkpoint holds no vision tower (no vision_model.* tensors): it takes '
                             'text prompts only')
        pixels, ratio = image.data.get('pixel_values'), image.data.get('aspect_ratios')
        if pixels is None or ratio is None or tuple(ratio.shape) != (1, 2):
            raise ValueError(f"a Llama 4 image needs its 'pixel_values' and 'aspect_ratios' [[rows, cols]], "
                             f'got {sorted(image.data)}')
        rows, cols = (int(n) for n in ratio[0])
        tiles = rows * cols + (rows * cols > 1)
        if tuple(pixels.shape) != (tiles, *self.tile_shape):
            raise ValueError(f'an image of {rows} x {cols} tiles takes pixels of {[tiles, *self.tile_shape]}, '
                             f'got {list(pixels.shape)}')
        tile = [True] * self.tokens_per_tile
        mask = [False] + ((tile + [False]) * cols * rows if tiles > 1 else []) + [False] + tile + [False]
        if len(mask) != image.length:
            raise ValueError(f'an image of {rows} x {cols} tiles spans {len(mask)} tokens, not {image.length}')
        return mask

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        """Features laid out as the images' spans: one row per span token, zeros where no ``<|patch|>`` is."""
        features = self.multi_modal_projector(self.vision_model(self._pixels(inputs))).flatten(0, 1)
        spans = []
        start = 0
        for image in inputs:
            mask = self.placeholder_mask(image)
            span = features.new_zeros(image.length, features.shape[-1])
            span[torch.tensor(mask, device=features.device)] = features[start:start + sum(mask)]
            start += sum(mask)
            spans.append(span)
        return torch.cat(spans)
