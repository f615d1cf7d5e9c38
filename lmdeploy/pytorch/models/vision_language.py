"""Vision-language models: a Llama-family language model whose image placeholder tokens take the
features of a vision encoder (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, LLaVA, InternVL 3).

The vision towers are transformers' own modules: they hold no KV cache, so the paged engine has
nothing to add to them, and reusing them keeps the image features exactly those of transformers.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import KVCache, LlamaForCausalLM, WeightTarget
from lmdeploy.pytorch.models.moe import MoEForCausalLM, split_stacked_experts
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# Checkpoint prefixes of the language model, in the hub layout and in transformers 5's own.
LANGUAGE_PREFIXES = ('language_model.model.', 'language_model.')
VISION_PREFIXES = ('visual.', 'vision_tower.', 'vision_model.', 'multi_modal_projector.')
QWEN_VISION_TOWERS = {'qwen2_vl': Qwen2VisionTransformerPretrainedModel,
                      'qwen2_5_vl': Qwen2_5_VisionTransformerPretrainedModel, 'qwen3_vl': Qwen3VLVisionModel,
                      'qwen3_vl_moe': Qwen3VLMoeVisionModel, 'qwen3_5': Qwen3_5VisionModel,
                      'qwen3_5_moe': Qwen3_5MoeVisionModel}


class VisionLanguageModel(LlamaForCausalLM):
    """The language model plus ``encode_images``; the images of a step are encoded in one batch."""

    uses_mrope = False
    # Set where an image's span also holds tokens of its own (row breaks, tile separators): only the rows
    # holding this id take features.
    image_token_id: int | None = None

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        """Features ``[sum of lengths, hidden]`` of the images, in order."""
        raise NotImplementedError

    def prompt_positions(self, num_tokens: int,
                         multimodal: list[MultiModalInput]) -> tuple[torch.Tensor | None, int]:
        """3-D rotary positions of a prompt and the offset of the tokens after it; None for 1-D models."""
        return None, 0

    def placeholder_mask(self, image: MultiModalInput) -> list[bool]:
        """Which tokens of an image's span are its placeholder (all of them; Mistral 3 breaks rows with others)."""
        return [True] * image.length

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The language model's embeddings (scaled where it scales them), image rows replaced by features."""
        x = super().embed(input_ids, ctx)
        batch = ctx.multimodal
        if batch is not None:
            features = self.encode_images(batch.inputs)
            rows, feature_rows = batch.token_rows, batch.feature_rows
            if self.image_token_id is not None:
                placeholder = input_ids[rows] == self.image_token_id
                rows, feature_rows = rows[placeholder], feature_rows[placeholder]
            x[rows] = features[feature_rows].to(x.dtype)
        return x

    def _pixels(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        weight = self.embed_tokens.weight
        return torch.cat([m.data['pixel_values'] for m in inputs]).to(weight.device, weight.dtype)

    def weight_target(self, name: str) -> WeightTarget | None:
        for prefix in LANGUAGE_PREFIXES:
            name = name.removeprefix(prefix)
        if not name.startswith(VISION_PREFIXES):
            return super().weight_target(name)
        try:
            return self.get_parameter(name), name, None
        except AttributeError:
            return None


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2-VL and Qwen2.5-VL: a Qwen2 language model with 3-D (M-RoPE) positions."""

    uses_mrope = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        mm = cfg.mm_config
        self.visual = self.make_vision_tower(mm)
        self.merge_size = mm.vision_config.spatial_merge_size
        self.requires_grad_(False)

    def make_vision_tower(self, mm: PretrainedConfig) -> nn.Module:
        """transformers' vision tower of the whole config ``mm``."""
        return QWEN_VISION_TOWERS[mm.model_type]._from_config(mm.vision_config)

    def run_vision(self, inputs: list[MultiModalInput]) -> BaseModelOutputWithPooling:
        """The vision tower's output for the images; ``pooler_output`` holds their merged features."""
        grid = torch.cat([m.data['image_grid_thw'] for m in inputs]).to(self.embed_tokens.weight.device)
        return self.visual(self._pixels(inputs), grid_thw=grid)

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        return self.run_vision(inputs).pooler_output

    def prompt_positions(self, num_tokens: int,
                         multimodal: list[MultiModalInput]) -> tuple[torch.Tensor | None, int]:
        """Text tokens count up on all three axes; an image's tokens take (t, h, w) grid positions
        from where the text stopped, and the text after it resumes past the grid's longest side."""
        parts = []
        position = cursor = 0
        for image in multimodal:
            parts.append(torch.arange(image.offset - cursor).expand(3, -1) + position)
            position += image.offset - cursor
            t, h, w = image.data['image_grid_thw'][0].tolist()
            h, w = h // self.merge_size, w // self.merge_size
            grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing='ij')
            parts.append(torch.stack(grid).reshape(3, -1) + position)
            position += max(h, w)
            cursor = image.end
        parts.append(torch.arange(num_tokens - cursor).expand(3, -1) + position)
        positions = torch.cat(parts, dim=1)
        return positions, int(positions.max()) + 1 - num_tokens


class LlavaForConditionalGeneration(VisionLanguageModel):
    """LLaVA: a CLIP-style vision tower whose chosen hidden layer is projected into the language model."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        mm = cfg.mm_config
        self.vision_tower = AutoModel.from_config(mm.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(mm)
        layer = mm.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.drop_cls = mm.vision_feature_select_strategy == 'default'
        self.requires_grad_(False)

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        hidden = self.vision_tower(self._pixels(inputs), output_hidden_states=True).hidden_states
        features = torch.cat([hidden[layer][:, int(self.drop_cls):] for layer in self.feature_layers], dim=-1)
        return self.multi_modal_projector(features).flatten(0, 1)


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL: a Qwen3 language model (q/k norms) with interleaved M-RoPE, whose first layers also take
    features of the vision tower's intermediate blocks (deepstack): after text layer ``i`` the image
    tokens' hidden states gain the ``i``-th of them."""

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        batch = ctx.multimodal
        if batch is None:
            return super().forward(input_ids, kv_caches, ctx)
        ctx.cos, ctx.sin = self.rotary(ctx, self.cfg.dtype)
        vision = self.run_vision(batch.inputs)
        x = self.embed_tokens(input_ids)
        x[batch.token_rows] = vision.pooler_output[batch.feature_rows].to(x.dtype)
        deepstack = vision.deepstack_features
        residual = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, kv_cache, ctx)
            if index < len(deepstack):  # x + residual is the layer's output: adding to x adds to it
                x[batch.token_rows] += deepstack[index][batch.feature_rows].to(x.dtype)
        x, _ = self.norm(x, residual)
        return x


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration, MoEForCausalLM):
    """Qwen3-VL-MoE: Qwen3-VL whose sparse layers are Qwen3-MoE blocks (softmax top-k, renormalized)."""

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Also splits each layer's stacked experts into per-expert weights (:func:`split_stacked_experts`)."""
        return split_stacked_experts(super().split_fused(weights), self.cfg.hidden_size)


def pixel_shuffle(features: torch.Tensor, ratio: float) -> torch.Tensor:
    """InternVL's downsampling of ``[tiles, side * side, C]`` patch features to ``[tiles, (side * ratio)**2,
    C / ratio**2]``: each ``1/ratio x 1/ratio`` block of neighbouring patches becomes one token."""
    tiles, tokens, channels = features.shape
    side = math.isqrt(tokens)
    kept = int(side * ratio)
    x = features.reshape(tiles, side, kept, int(channels / ratio))
    x = x.transpose(1, 2).reshape(tiles, kept, kept, int(channels / ratio**2))
    return x.transpose(1, 2).reshape(tiles, kept * kept, -1)


class InternVLForConditionalGeneration(VisionLanguageModel):
    """InternVL 3: each tile of an image through the InternViT tower, pixel-shuffled and projected by an MLP
    into a Qwen2 or Llama language model; an image's features are those of its tiles in order."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        mm = cfg.mm_config
        self.vision_tower = AutoModel.from_config(mm.vision_config)
        self.multi_modal_projector = InternVLMultiModalProjector(mm)
        self.feature_layer = mm.vision_feature_layer
        self.drop_cls = mm.vision_feature_select_strategy == 'default'
        self.downsample_ratio = mm.downsample_ratio
        self.requires_grad_(False)

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        out = self.vision_tower(self._pixels(inputs), output_hidden_states=self.feature_layer != -1)
        features = out.last_hidden_state if self.feature_layer == -1 else out.hidden_states[self.feature_layer]
        features = pixel_shuffle(features[:, int(self.drop_cls):], self.downsample_ratio)
        return self.multi_modal_projector(features).flatten(0, 1)
