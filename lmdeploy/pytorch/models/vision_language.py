"""Vision-language models: a Llama-family language model whose image placeholder tokens take the
features of a vision encoder (Qwen2-VL, Qwen2.5-VL, LLaVA).

The vision towers are transformers' own modules: they hold no KV cache, so the paged engine has
nothing to add to them, and reusing them keeps the image features exactly those of transformers.
"""
from __future__ import annotations

import torch
from transformers import AutoModel
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import LlamaForCausalLM, WeightTarget
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.pytorch.step_context import StepContext

# Checkpoint prefixes of the language model, in the hub layout and in transformers 5's own.
LANGUAGE_PREFIXES = ('language_model.model.', 'language_model.')
VISION_PREFIXES = ('visual.', 'vision_tower.', 'multi_modal_projector.')


class VisionLanguageModel(LlamaForCausalLM):
    """The language model plus ``encode_images``; the images of a step are encoded in one batch."""

    uses_mrope = False

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        """Features ``[sum of lengths, hidden]`` of the images, in order."""
        raise NotImplementedError

    def prompt_positions(self, num_tokens: int,
                         multimodal: list[MultiModalInput]) -> tuple[torch.Tensor | None, int]:
        """3-D rotary positions of a prompt and the offset of the tokens after it; None for 1-D models."""
        return None, 0

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        batch = ctx.multimodal
        if batch is not None:
            features = self.encode_images(batch.inputs)
            x[batch.token_rows] = features[batch.feature_rows].to(x.dtype)
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
        tower = (Qwen2_5_VisionTransformerPretrainedModel if mm.model_type == 'qwen2_5_vl'
                 else Qwen2VisionTransformerPretrainedModel)
        self.visual = tower._from_config(mm.vision_config)
        self.merge_size = mm.vision_config.spatial_merge_size
        self.requires_grad_(False)

    def encode_images(self, inputs: list[MultiModalInput]) -> torch.Tensor:
        grid = torch.cat([m.data['image_grid_thw'] for m in inputs]).to(self.embed_tokens.weight.device)
        return self.visual(self._pixels(inputs), grid_thw=grid).pooler_output

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
