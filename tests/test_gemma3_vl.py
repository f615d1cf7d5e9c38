"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) against transformers on a tiny random model saved by
transformers: its processor's prompts, 32 greedy tokens and first-step logits in fp32 on text and on one- and
two-image prompts (image tokens attending to each other both ways), batching, chunked prefill and prefix-cache
hits, and both checkpoint layouts."""
from __future__ import annotations

import shutil

import pytest
import torch
from family_checks import assert_batched_chunked_and_cached_equal_solo, assert_vl_matches_transformers
from helpers import add_requests, collect, make_engine, run
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor
from vl_models import hf_vl_inputs, hf_vl_model, make_processor, random_image, save_tiny_vl_model

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.vl.processor import ProcessedPrompt
from lmdeploy.vl.resize import with_torchvision_resize

IMAGES = [random_image(1), random_image(2, (60, 60)), random_image(3, (150, 100))]
TEXT_PROMPTS = ['plain text', 'a longer prompt about nothing in particular, past the local layers\' window']
IMAGE_PROMPTS = [('describe', IMAGES[0]), ('compare', [IMAGES[1], IMAGES[2]])]


@pytest.fixture(scope='module')
def gemma3(tmp_path_factory) -> str:
    return save_tiny_vl_model('gemma3', str(tmp_path_factory.mktemp('gemma3')))


@pytest.fixture(scope='module')
def hf_model(gemma3):
    return hf_vl_model(gemma3)


def hf_inputs(model, prompt: ProcessedPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs, ``token_type_ids`` marking the image tokens (what its processor returns)."""
    return hf_vl_inputs(model, prompt.input_ids, [image.data for image in prompt.multimodal])


def assert_matches_transformers(path: str, hf_model, prompts: list[ProcessedPrompt]) -> list[list[int]]:
    return assert_vl_matches_transformers(path, hf_model, prompts, [hf_inputs(hf_model, p) for p in prompts])


def test_text_prompts_match_transformers(gemma3, hf_model):
    processor = make_processor(gemma3)
    prompts = [processor.process(prompt) for prompt in TEXT_PROMPTS]
    assert len(prompts[1].input_ids) > 2 * hf_model.config.text_config.sliding_window
    outs = assert_matches_transformers(gemma3, hf_model, prompts)
    assert len(set(outs[0])) > 2, 'the tiny model must not repeat one token'


@pytest.fixture(scope='module')
def image_prompts(gemma3) -> list[ProcessedPrompt]:
    processor = make_processor(gemma3)
    return [processor.process(prompt) for prompt in IMAGE_PROMPTS]


def test_image_prompts_match_transformers(gemma3, hf_model, image_prompts):
    """One- and two-image prompts; the image tokens' attention to the later tokens of their image matters."""
    outs = assert_matches_transformers(gemma3, hf_model, image_prompts)
    assert outs[0] != outs[1], 'the images must change the answer'
    inputs = hf_inputs(hf_model, image_prompts[1])
    with torch.no_grad():
        both_ways = hf_model(**inputs).logits[0, -1]
        causal = hf_model(**{**inputs, 'token_type_ids': None}).logits[0, -1]
    assert (both_ways - causal).abs().max() > 1e-2


def test_batched_chunked_and_cached_equal_solo(gemma3, image_prompts):
    """Chunks of 5 tokens would cut each 4-token image; blocks of 4 tokens would end a cached prefix in one."""
    prompts = [make_processor(gemma3).process(TEXT_PROMPTS[0])] + image_prompts
    assert_batched_chunked_and_cached_equal_solo(
        gemma3, prompts, chunked={'block_size': 4, 'max_prefill_token_num': 5}, cached={'block_size': 4},
        warm=slice(1, None))


def test_chunks_and_cache_hits_keep_each_image_whole(gemma3, image_prompts, monkeypatch):
    """Every prefill chunk holds each image it touches whole, in chunks of 5 tokens and after prefix-cache hits
    on blocks of 4 tokens that would end inside an image; every block is given back."""
    prompt = image_prompts[1]
    spans = [(image.offset, image.end) for image in prompt.multimodal]
    engine = make_engine(gemma3, block_size=4, max_prefill_token_num=5)
    chunks = []
    build_inputs = engine.runner.build_inputs

    def record(plan):
        chunks.extend((item.seq.num_computed, item.seq.num_computed + item.num_tokens) for item in plan.prefill)
        return build_inputs(plan)

    monkeypatch.setattr(engine.runner, 'build_inputs', record)
    expected = run(engine, [prompt])
    for start, end in chunks:
        assert not any(s < start < e or s < end < e for s, e in spans), (start, end, spans)
    assert any(end == s for _, end in chunks for s, _ in spans), 'a chunk must have stopped before an image'
    chunks.clear()
    seq_ids = add_requests(engine, [prompt])
    seq = engine.sequences[seq_ids[0]]
    assert collect(engine, seq_ids) == expected
    assert seq.num_cached > 0 and not any(s < seq.num_cached < e for s, e in spans)
    assert any(s < n * 4 < e for s, e in spans for n in range(1, len(prompt.input_ids) // 4 + 1)), \
        'some block boundary must fall inside an image'
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_image_longer_than_a_prefill_step_is_refused(gemma3, image_prompts):
    engine = make_engine(gemma3, block_size=2, max_prefill_token_num=3)
    prompt = image_prompts[0]
    with pytest.raises(ValueError, match='max_prefill_token_num'):
        engine.add_request(prompt.input_ids, None, prompt.multimodal)
    assert not engine.sequences


def test_processor_expands_images_as_transformers_does(gemma3):
    """Each <start_of_image> of the chat template becomes \\n\\n<start_of_image>, 4 image tokens, <end_of_image>\\n\\n,
    token for token as transformers' Gemma3Processor writes them, with its pixels (its PIL backend resizing as the
    torchvision one does: test_vl_torchvision_reference.py holds those pixels to torchvision's)."""
    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    image_processor = with_torchvision_resize(AutoImageProcessor.from_pretrained(gemma3, backend='pil'))
    reference = Gemma3Processor(image_processor, tokenizer, image_seq_length=4)
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


def test_language_model_runs_in_the_native_decoder_stack(gemma3, image_prompts, native_gemms):
    """bf16 on packed weights: the layers run in the native decoder stack, image steps included (their key
    limits reach its prefill attention), as the layers' own forward runs them."""
    engine = Engine(gemma3, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None
    outs = run(engine, image_prompts)
    model.native_stack = None
    assert run(engine, image_prompts) == outs
