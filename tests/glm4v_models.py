"""Tiny random GLM-4.1V, GLM-4.5V and GLM-4.6V models saved by transformers (vision tower and language model tiny),
with a tokenizer holding GLM's image tokens and a chat template that writes ``<|begin_of_image|><|image|>
<|end_of_image|>`` for an image, as GLM's own does."""
from __future__ import annotations

import torch
from conftest import VOCAB_SIZE, build_tokenizer
from transformers import AutoModelForImageTextToText, Glm46VConfig, Glm4vConfig, Glm4vMoeConfig
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from vl_models import image_chat_template

IMAGE_TOKENS = ['<|begin_of_image|>', '<|image|>', '<|end_of_image|>', '<|begin_of_video|>', '<|video|>',
                '<|end_of_video|>']
GLM_IMAGE = '<|begin_of_image|><|image|><|end_of_image|>'
# 14 px patches on a learned 4 x 4 position grid (resampled to each image), 2 x 2 of them merged into one token
VISION = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, image_size=56)
# heads of 16 features, 8 of which rotate: 4 frequencies, turned by the temporal, height and width axes in bands
ROPE = {'rope_type': 'default', 'rope_theta': 10000.0, 'partial_rotary_factor': 0.5, 'mrope_section': [2, 1, 1]}
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB_SIZE, max_position_embeddings=1024, rope_parameters=ROPE)
# GLM-4.5V's language model: a dense first layer, then a shared expert and top-2 of 4 routed ones
MOE_TEXT = dict(TEXT, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
# model kind -> (config class, text config)
KINDS = {'glm4v': (Glm4vConfig, {**TEXT, 'model_type': 'glm4v_text'}),
         'glm4v_moe': (Glm4vMoeConfig, {**MOE_TEXT, 'model_type': 'glm4v_moe_text'}),
         'glm46v': (Glm46VConfig, {**TEXT, 'model_type': 'glm4v_text'}),
         'glm46v_moe': (Glm46VConfig, {**MOE_TEXT, 'model_type': 'glm4v_moe_text'})}


def save_tiny_glm4v(kind: str, path: str) -> str:
    """Model, tokenizer and image processor (images of 1 to 16 merged patches) of ``kind`` in ``path``."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': IMAGE_TOKENS})
    tokenizer.chat_template = image_chat_template(GLM_IMAGE)
    ids = dict(zip(IMAGE_TOKENS, tokenizer.convert_tokens_to_ids(IMAGE_TOKENS)))
    config_class, text = KINDS[kind]
    config = config_class(text_config={**text, 'eos_token_id': tokenizer.eos_token_id}, vision_config=VISION,
                          image_token_id=ids['<|image|>'], video_token_id=ids['<|video|>'],
                          image_start_token_id=ids['<|begin_of_image|>'], image_end_token_id=ids['<|end_of_image|>'],
                          video_start_token_id=ids['<|begin_of_video|>'], video_end_token_id=ids['<|end_of_video|>'],
                          eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # wide enough that greedy outputs vary and depend on the image
            param.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    merged = 2 * 28 * 28  # two frames (an image is doubled) of one merged patch
    Glm4vImageProcessorPil(size={'shortest_edge': merged, 'longest_edge': 16 * merged}).save_pretrained(path)
    return path
