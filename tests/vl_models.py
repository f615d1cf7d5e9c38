"""Tiny random vision-language models (Qwen2-VL, Qwen2.5-VL, LLaVA) saved with transformers, and
transformers' greedy output on them as the reference."""
from __future__ import annotations

import numpy as np
import torch
from conftest import VOCAB_SIZE, build_tokenizer
from PIL import Image
from transformers import (AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2_5_VLConfig,
                          Qwen2VLConfig)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

QWEN_IMAGE = '<|vision_start|><|image_pad|><|vision_end|>'
LLAVA_IMAGE = '<image>\n'
SPECIAL_TOKENS = ['<|vision_start|>', '<|vision_end|>', '<|image_pad|>', '<|video_pad|>', '<image>']


def _template(image: str) -> str:
    """ChatML whose message contents may be lists of text and image parts."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + image +
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB_SIZE, max_position_embeddings=1024, bos_token_id=0, eos_token_id=2)
QWEN_VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2)
QWEN25_VISION = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])


def _config(kind: str, ids: dict[str, int]):
    qwen_ids = dict(image_token_id=ids['<|image_pad|>'], video_token_id=ids['<|video_pad|>'],
                    vision_start_token_id=ids['<|vision_start|>'], vision_end_token_id=ids['<|vision_end|>'])
    mrope = {'rope_type': 'default', 'rope_theta': 10000.0, 'mrope_section': [2, 3, 3]}
    if kind == 'qwen2_vl':
        return Qwen2VLConfig(text_config={**TEXT, 'rope_parameters': mrope}, vision_config=QWEN_VISION, **qwen_ids)
    if kind == 'qwen2_5_vl':
        return Qwen2_5_VLConfig(text_config={**TEXT, 'rope_parameters': mrope}, vision_config=QWEN25_VISION,
                                tie_word_embeddings=True, **qwen_ids)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=56, patch_size=14, projection_dim=32)
    return LlavaConfig(vision_config=vision, text_config=LlamaConfig(**TEXT), image_token_id=ids['<image>'])


VL_KINDS = ('llava', 'qwen2_5_vl', 'qwen2_vl')


def save_tiny_vl_model(kind: str, path: str) -> str:
    """Saves model, tokenizer (with an image-aware chat template) and image processor into ``path``."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': SPECIAL_TOKENS})
    tokenizer.chat_template = _template(LLAVA_IMAGE if kind == 'llava' else QWEN_IMAGE)
    config = _config(kind, {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS})
    config.get_text_config().eos_token_id = config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)  # wide enough that greedy outputs vary and depend on the image
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if kind == 'llava':
        processor = CLIPImageProcessorPil(size={'shortest_edge': 56}, crop_size={'height': 56, 'width': 56})
    else:
        processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    processor.save_pretrained(path)
    return path


def random_image(seed: int, size=(90, 60)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_vl_greedy(path: str, input_ids: list[int], images: list[dict[str, torch.Tensor]], n: int = 16) -> list[int]:
    """transformers' greedy continuation of ``input_ids`` with the images' processed tensors."""
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([input_ids])
    kwargs = {key: torch.cat([image[key] for image in images]) for key in images[0]}
    if 'image_grid_thw' in kwargs:
        kwargs['mm_token_type_ids'] = (ids == model.config.image_token_id).int()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, top_k=None,
                         top_p=None, temperature=None, **kwargs)
    return out[0, len(input_ids):].tolist()
