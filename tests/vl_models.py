"""Tiny random vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, LLaVA,
InternVL 3, Mistral 3, Gemma 3) saved with transformers, and transformers' greedy output on them as the reference."""
from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from conftest import MINISTRAL3_ROPE, VOCAB_SIZE, build_tokenizer
from PIL import Image
from transformers import (AutoConfig, AutoModelForImageTextToText, CLIPVisionConfig, Gemma3Config, InternVLConfig,
                          LlamaConfig, LlavaConfig, Mistral3Config, Qwen2_5_VLConfig, Qwen2Config, Qwen2VLConfig,
                          Qwen3_5Config, Qwen3_5MoeConfig, Qwen3Config, Qwen3VLConfig, Qwen3VLMoeConfig)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lmdeploy.tokenizer import Tokenizer
from lmdeploy.vl.image_inputs import ImageInputs
from lmdeploy.vl.processor import MultiModalProcessor

QWEN_IMAGE = '<|vision_start|><|image_pad|><|vision_end|>'
LLAVA_IMAGE = '<image>\n'
INTERNVL_IMAGE = '<IMG_CONTEXT>\n'  # InternVL's processor wraps each image's span in <img> ... </img>
SPECIAL_TOKENS = ['<|vision_start|>', '<|vision_end|>', '<|image_pad|>', '<|video_pad|>', '<image>']
# InternVL's tokenizer names its image tokens; its processor reads them by these names
INTERNVL_TOKENS = {'start_image_token': '<img>', 'end_image_token': '</img>', 'context_image_token': '<IMG_CONTEXT>',
                   'video_token': '<video>'}
MISTRAL3_TOKENS = ['[IMG]', '[IMG_BREAK]', '[IMG_END]']
# Gemma 3's tokenizer names its image tokens too; its chat template writes <start_of_image> for an image
GEMMA3_TOKENS = {'boi_token': '<start_of_image>', 'eoi_token': '<end_of_image>', 'image_token': '<image_soft_token>'}


def make_processor(path: str) -> MultiModalProcessor:
    """The engine's prompt processor of the model saved in ``path``."""
    tokenizer = Tokenizer(path)
    return MultiModalProcessor(tokenizer, image_inputs=ImageInputs.for_model(path, AutoConfig.from_pretrained(path),
                                                                             tokenizer.hf))


def image_chat_template(image: str) -> str:
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
# a 4 x 4 grid of learned positions; features of both blocks go into the first two text layers (deepstack)
QWEN3_VISION = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                    deepstack_visual_indexes=[0, 1])
# Qwen3.5: Qwen3-VL's tower without deepstack; a hybrid language model of three linear-attention layers then a
# full-attention one whose heads rotate half their features, interleaved M-RoPE over those 8 frequencies
QWEN3_5_VISION = {key: value for key, value in QWEN3_VISION.items() if key != 'deepstack_visual_indexes'}
QWEN3_5_TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                    linear_conv_kernel_dim=4, vocab_size=VOCAB_SIZE, max_position_embeddings=1024,
                    rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0, 'partial_rotary_factor': 0.5,
                                     'mrope_section': [4, 2, 2], 'mrope_interleaved': True})
QWEN3_5_CONFIGS = {
    'qwen3_5': (Qwen3_5Config, dict(intermediate_size=128)),
    'qwen3_5_moe': (Qwen3_5MoeConfig, dict(moe_intermediate_size=32, shared_expert_intermediate_size=40,
                                           num_experts=4, num_experts_per_tok=2))}
# Qwen3-VL-MoE's language model: a dense first layer, then top-2 of 4 experts
QWEN3_MOE_TEXT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[0])
# 56 px tiles of 14 px patches: 16 patches, 4 tokens after the pixel shuffle
INTERNVL_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       image_size=56, patch_size=14)
# Pixtral: 16 px patches, 2-D rotary up to 128 px; the projector merges 2 x 2 patches, so images come in 32 px steps
MISTRAL3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                       image_size=128, patch_size=16)
MISTRAL3_LONGEST_EDGE = 128
# Mistral Small 4's language model: 4 heads over a latent of 32 (rotary 8, rank-48 queries), 8 experts (top 2) and a
# shared one, YaRN with the queries scaled by position every 32
MISTRAL4_TEXT = dict(model_type='mistral4', num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
                     qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
                     num_experts_per_tok=2, pad_token_id=None,
                     rope_parameters={'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0,
                                      'original_max_position_embeddings': 32, 'beta_fast': 32.0, 'beta_slow': 1.0,
                                      'mscale': 1.0, 'mscale_all_dim': 1.0, 'llama_4_scaling_beta': 0.1})
# Gemma 3: a SigLIP tower on 56 px images of 14 px patches (4 x 4), average-pooled to 2 x 2 = 4 tokens; a local
# layer of window 8 (shorter than the prompts) between global ones, each kind on its own rope base
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                     patch_size=14)
GEMMA3_TEXT = dict(TEXT, num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=['full_attention', 'sliding_attention', 'full_attention'],
                   rope_parameters={'sliding_attention': {'rope_type': 'default', 'rope_theta': 100.0},
                                    'full_attention': {'rope_type': 'default', 'rope_theta': 10000.0}})


def _config(kind: str, ids: dict[str, int]):
    if kind.startswith('mistral3'):  # mistral3_first_layer: the features of the tower's first layer
        text = {**TEXT, 'model_type': 'mistral', 'head_dim': 16}
        if kind == 'mistral3_ministral3':  # a Ministral 3 language model
            text.update(model_type='ministral3', rope_parameters=MINISTRAL3_ROPE)
        if kind == 'mistral3_mistral4':  # Mistral Small 4: a Mistral 4 language model (MLA, experts)
            text = {**TEXT, **MISTRAL4_TEXT}
        return Mistral3Config(text_config=text,
                              vision_config={**MISTRAL3_VISION, 'model_type': 'pixtral'},
                              image_token_id=ids['[IMG]'], tie_word_embeddings=False,
                              vision_feature_layer=-2 if kind == 'mistral3_first_layer' else -1)
    if kind == 'gemma3':
        return Gemma3Config(text_config={**GEMMA3_TEXT, 'model_type': 'gemma3_text'}, vision_config=GEMMA3_VISION,
                            mm_tokens_per_image=4, image_token_index=ids['<image_soft_token>'],
                            boi_token_index=ids['<start_of_image>'], eoi_token_index=ids['<end_of_image>'])
    if kind == 'internvl':
        return InternVLConfig(text_config={**TEXT, 'model_type': 'qwen2'}, vision_config=INTERNVL_VISION,
                              image_token_id=ids['<IMG_CONTEXT>'], image_seq_length=4)
    if kind == 'internvl_llama':  # a Llama language model fed by the tower's last but one layer
        return InternVLConfig(text_config={**TEXT, 'model_type': 'llama'}, vision_config=INTERNVL_VISION,
                              image_token_id=ids['<IMG_CONTEXT>'], image_seq_length=4, vision_feature_layer=-2)
    qwen_ids = dict(image_token_id=ids['<|image_pad|>'], video_token_id=ids['<|video_pad|>'],
                    vision_start_token_id=ids['<|vision_start|>'], vision_end_token_id=ids['<|vision_end|>'])
    mrope = {'rope_type': 'default', 'rope_theta': 10000.0, 'mrope_section': [2, 3, 3]}
    if kind in QWEN3_5_CONFIGS:
        config_class, mlp = QWEN3_5_CONFIGS[kind]
        return config_class(text_config={**QWEN3_5_TEXT, **mlp}, vision_config=QWEN3_5_VISION,
                            tie_word_embeddings=False, **qwen_ids)
    if kind == 'qwen3_vl':
        text = {**TEXT, 'head_dim': 16, 'rope_parameters': {**mrope, 'mrope_section': [4, 2, 2]}}
        return Qwen3VLConfig(text_config=text, vision_config=QWEN3_VISION, **qwen_ids)
    if kind == 'qwen3_vl_moe':
        text = {**TEXT, 'head_dim': 16, 'rope_parameters': {**mrope, 'mrope_section': [4, 2, 2]}, **QWEN3_MOE_TEXT}
        return Qwen3VLMoeConfig(text_config=text, vision_config=QWEN3_VISION, **qwen_ids)
    if kind == 'qwen2_vl':
        return Qwen2VLConfig(text_config={**TEXT, 'rope_parameters': mrope}, vision_config=QWEN_VISION, **qwen_ids)
    if kind == 'qwen2_5_vl':
        return Qwen2_5_VLConfig(text_config={**TEXT, 'rope_parameters': mrope}, vision_config=QWEN25_VISION,
                                tie_word_embeddings=True, **qwen_ids)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=56, patch_size=14, projection_dim=32)
    text = {'llava_qwen2': Qwen2Config, 'llava_qwen3': Qwen3Config}.get(kind, LlamaConfig)(**TEXT, head_dim=16)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=ids['<image>'])


# parameter name part -> std of the random weights, where 0.5 does not make greedy outputs vary: Gemma 3's
# embeddings, scaled by sqrt(hidden) and tied to the LM head, would make it repeat the last token; Qwen3.5's gated
# layers would give every prompt, images or not, the same answer
INIT_STDS = {'gemma3': {'embed_tokens': 0.05, '': 1.0}, 'qwen3_5': {'': 0.2}, 'qwen3_5_moe': {'': 0.2}}
VL_KINDS = ('llava', 'qwen2_5_vl', 'qwen2_vl', 'internvl', 'qwen3_vl', 'mistral3')
IMAGE_TEMPLATES = {'llava': LLAVA_IMAGE, 'llava_qwen2': LLAVA_IMAGE, 'llava_qwen3': LLAVA_IMAGE,
                   'gemma3': GEMMA3_TOKENS['boi_token']}
# the tokens a family's tokenizer names (written into its tokenizer config)
NAMED_TOKENS = {'internvl': INTERNVL_TOKENS, 'gemma3': GEMMA3_TOKENS}


def save_tiny_vl_model(kind: str, path: str) -> str:
    """Saves model, tokenizer (with an image-aware chat template) and image processor into ``path``."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    internvl, mistral3 = kind.startswith('internvl'), kind.startswith('mistral3')
    named = NAMED_TOKENS.get('internvl' if internvl else kind)
    special = list(named.values()) if named else MISTRAL3_TOKENS if mistral3 else SPECIAL_TOKENS
    tokenizer.add_special_tokens({'additional_special_tokens': special})
    image = INTERNVL_IMAGE if internvl else MISTRAL3_TOKENS[0] if mistral3 else IMAGE_TEMPLATES.get(kind, QWEN_IMAGE)
    tokenizer.chat_template = image_chat_template(image)
    config = _config(kind, {t: tokenizer.convert_tokens_to_ids(t) for t in special})
    config.get_text_config().eos_token_id = config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    stds = INIT_STDS.get(kind, {})
    with torch.no_grad():
        for name, param in model.named_parameters():
            # wide enough that greedy outputs vary and depend on the image
            param.normal_(0, next((std for part, std in stds.items() if part in name), 0.5))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if named:
        name_image_tokens(path, named)
    if internvl:
        processor = GotOcr2ImageProcessorPil(size={'height': 56, 'width': 56}, max_patches=4)
    elif kind.startswith(('qwen3_vl', 'qwen3_5')):
        processor = Qwen2VLImageProcessorPil(patch_size=16, size={'shortest_edge': 32 * 32,
                                                                  'longest_edge': 32 * 32 * 9})
    elif mistral3:
        processor = PixtralImageProcessorPil(size={'longest_edge': MISTRAL3_LONGEST_EDGE})
    elif kind == 'gemma3':
        processor = Gemma3ImageProcessorPil(size={'height': 56, 'width': 56})
    elif kind.startswith('llava'):
        processor = CLIPImageProcessorPil(size={'shortest_edge': 56}, crop_size={'height': 56, 'width': 56})
    else:
        processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    processor.save_pretrained(path)
    return path


def update_tokenizer_config(path: str, **fields) -> None:
    """Sets ``fields`` in the tokenizer config saved in the folder ``path``."""
    config_path = os.path.join(path, 'tokenizer_config.json')
    with open(config_path) as f:
        config = json.load(f)
    config.update(fields)
    with open(config_path, 'w') as f:
        json.dump(config, f)


def name_image_tokens(path: str, named: dict[str, str]) -> None:
    """Records the image tokens by name in the saved tokenizer config, as InternVL's and Gemma 3's checkpoints do."""
    update_tokenizer_config(path, extra_special_tokens=named)


def random_image(seed: int, size=(90, 60)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def batch_image_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The images' tensors in one batch; pixels of different sizes (Pixtral's) zero-padded to the largest, as
    Pixtral's image processor pads a batch."""
    if tensors[0].dim() == 4:
        height, width = (max(t.shape[dim] for t in tensors) for dim in (2, 3))
        tensors = [F.pad(t, (0, width - t.shape[3], 0, height - t.shape[2])) for t in tensors]
    return torch.cat(tensors)


def hf_vl_inputs(model, input_ids: list[int], images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """transformers' inputs for a prompt whose images the engine's processor preprocessed."""
    ids = torch.tensor([input_ids])
    kwargs = {key: batch_image_tensors([image[key] for image in images]) for key in images[0]} if images else {}
    if 'image_grid_thw' in kwargs:
        kwargs['mm_token_type_ids'] = (ids == model.config.image_token_id).int()
    if model.config.model_type == 'gemma3':  # its image tokens attend to each other both ways
        kwargs['token_type_ids'] = (ids == model.config.image_token_id).int()
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)


def hf_vl_model(path: str):
    """transformers' vision-language model of ``path`` in fp32, for evaluation, generating past its EOS."""
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_vl_greedy(path: str, input_ids: list[int], images: list[dict[str, torch.Tensor]], n: int = 16) -> list[int]:
    """transformers' greedy continuation of ``input_ids`` with the images' processed tensors."""
    model = hf_vl_model(path)
    out = model.generate(**hf_vl_inputs(model, input_ids, images), max_new_tokens=n, do_sample=False, top_k=None,
                         top_p=None, temperature=None)
    return out[0, len(input_ids):].tolist()
