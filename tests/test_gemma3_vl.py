"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) against transformers on a tiny random model saved by
transformers: its processor's prompts, 32 greedy tokens and first-step logits in fp32 on text and on one- and
two-image prompts (image tokens attending to each other both ways), batching, chunked prefill and prefix-cache
hits, and both checkpoint layouts."""
from __future__ import annotations

import shutil

import pytest
import torch
from family_checks import assert_first_logits_close
from helpers import make_engine, run
from safetensors.torch import load_file, save_file
from test_vl_families import make_processor
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Gemma3Processor
from vl_models import hf_vl_inputs, random_image, save_tiny_vl_model

from lmdeploy.vl.processor import ProcessedPrompt

IMAGES = [random_image(1), random_image(2, (60, 60)), random_image(3, (150, 100))]
TEXT_PROMPTS = ['plain text', 'a longer prompt about nothing in particular, past the local layers\' window']


@pytest.fixture(scope='module')
def gemma3(tmp_path_factory) -> str:
    return save_tiny_vl_model('gemma3', str(tmp_path_factory.mktemp('gemma3')))


@pytest.fixture(scope='module')
def hf_model(gemma3):
    model = AutoModelForImageTextToText.from_pretrained(gemma3, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_inputs(model, prompt: ProcessedPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs, ``token_type_ids`` marking the image tokens (what its processor returns)."""
    return hf_vl_inputs(model, prompt.input_ids, [image.data for image in prompt.multimodal])


def assert_matches_transformers(path: str, hf_model, prompts: list[ProcessedPrompt]) -> list[list[int]]:
    """32 greedy tokens of ``prompts`` in one batch and their first-step logits (within 1e-3) equal
    transformers'; returns the tokens."""
    outs = run(make_engine(path), prompts)
    for prompt, out in zip(prompts, outs):
        expected = hf_model.generate(**hf_inputs(hf_model, prompt), max_new_tokens=32, do_sample=False, top_k=None,
                                     top_p=None, temperature=None)
        assert out == expected[0, len(prompt.input_ids):].tolist()
    with torch.no_grad():
        refs = [hf_model(**hf_inputs(hf_model, prompt)).logits[0, -1] for prompt in prompts]
    assert_first_logits_close(make_engine(path), prompts, refs)
    return outs


def test_text_prompts_match_transformers(gemma3, hf_model):
    processor = make_processor(gemma3)
    prompts = [processor.process(prompt) for prompt in TEXT_PROMPTS]
    assert len(prompts[1].input_ids) > 2 * hf_model.config.text_config.sliding_window
    outs = assert_matches_transformers(gemma3, hf_model, prompts)
    assert len(set(outs[0])) > 2, 'the tiny model must not repeat one token'


def test_processor_expands_images_as_transformers_does(gemma3):
    """Each <start_of_image> of the chat template becomes \\n\\n<start_of_image>, 4 image tokens, <end_of_image>\\n\\n,
    token for token as transformers' Gemma3Processor writes them, with its pixels."""
    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    reference = Gemma3Processor(AutoImageProcessor.from_pretrained(gemma3, backend='pil'), tokenizer,
                                image_seq_length=4)
    content = [{'type': 'text', 'text': 'first'}, {'type': 'image', 'image': IMAGES[0]},
               {'type': 'text', 'text': 'then\n'}, {'type': 'image', 'image': IMAGES[2]},
               {'type': 'text', 'text': ' compare'}]
    messages = [{'role': 'user', 'content': content}]
    ours = make_processor(gemma3).process(messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference(text=text, images=[IMAGES[0], IMAGES[2]], return_tensors='pt', add_special_tokens=False)
    assert ours.input_ids == expected['input_ids'][0].tolist()
    torch.testing.assert_close(torch.cat([image.data['pixel_values'] for image in ours.multimodal]),
                               expected['pixel_values'], rtol=0, atol=0)
    image_rows = [i for image in ours.multimodal for i in range(image.offset, image.end)]
    assert image_rows == torch.nonzero(expected['token_type_ids'][0]).flatten().tolist()


def test_transformers_5_checkpoint_layout_loads(gemma3, tmp_path):
    """transformers 5 names the tensors model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*
    where the hub's checkpoints have language_model.model.*, vision_tower.*, multi_modal_projector.*."""
    renamed = shutil.copytree(gemma3, tmp_path / 'renamed')
    for file in renamed.glob('*.safetensors'):
        tensors = load_file(file)
        assert any(name.startswith('language_model.model.') for name in tensors)
        save_file({'model.' + name.replace('language_model.model.', 'language_model.'): t
                   for name, t in tensors.items()}, file, metadata={'format': 'pt'})
    prompts = [make_processor(gemma3).process(('describe', IMAGES[0]))]
    assert run(make_engine(str(renamed)), prompts) == run(make_engine(gemma3), prompts)
