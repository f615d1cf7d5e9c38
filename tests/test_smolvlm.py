"""SmolVLM (``SmolVLMForConditionalGeneration``) and Idefics3 (``Idefics3ForConditionalGeneration``) against
transformers on tiny random models saved by transformers: a vision tower on 56 px tiles of 14 px patches (4 tokens a
tile after the pixel shuffle by 2), images resized to at most 112 px and cut into up to 2 x 2 tiles plus the global
one, a Llama language model. The spans transformers' processors write, 32 greedy tokens and first-step logits in
fp32 on text, one-image and two-image prompts, batching, chunked prefill, prefix-cache hits, a server chat with a
data-URL image, and clear errors for spans that do not fit the image's tiles."""
from __future__ import annotations

import openai
import pytest
import torch
from conftest import build_tokenizer
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_tp2_equals_tp1,
                           assert_vl_matches_transformers)
from helpers import make_engine, run
from PIL import Image
from server_helpers import serve, tiny_engine
from test_vl import data_url, png_bytes
from test_vl_server import assert_image_chat_matches_transformers, chat, image_message
from transformers import AutoModelForImageTextToText, AutoTokenizer, Idefics3Config, SmolVLMConfig
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from vl_models import hf_vl_model, make_processor, random_image

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.vl.processor import ProcessedPrompt

GRID_TOKENS = [f'<row_{r}_col_{c}>' for r in (1, 2) for c in (1, 2)]
IMAGE_TOKENS = ['<fake_token_around_image>', '<image>', '<global-img>', '<end_of_utterance>'] + GRID_TOKENS
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=336, max_position_embeddings=1024, model_type='llama')
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
              patch_size=14)
# the chat template of the hub's SmolVLM checkpoints (chat_template.json): every message's content a list of parts
CHAT_TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]"
                 "['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if "
                 "line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
                 "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
                 "{% endif %}")
PROCESSORS = {'smolvlm': (SmolVLMConfig, SmolVLMImageProcessorPil),
              'idefics3': (Idefics3Config, Idefics3ImageProcessorPil)}
# 90x60 -> 112x74 -> 2 x 2 tiles and the global one; 60x60 -> 112x112 -> 2 x 2; 40x100 -> 46x112 -> 2 x 1
IMAGES = [random_image(1), random_image(2, (60, 60)), random_image(3, (40, 100))]
PROMPTS = ['plain text', ('describe', IMAGES[0]), ('compare', [IMAGES[1], IMAGES[2]])]


def save_tiny_smolvlm(kind: str, path: str) -> str:
    """Model, tokenizer (SmolVLM's chat template, its image tokens) and image processor in ``path``."""
    torch.manual_seed(0)
    config_class, processor_class = PROCESSORS[kind]
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': IMAGE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    config = config_class(text_config=TEXT | {'eos_token_id': tokenizer.eos_token_id}, vision_config=VISION,
                          scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids('<image>'),
                          tie_word_embeddings=False)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor_class(size={'longest_edge': 112}, max_image_size={'longest_edge': 56}).save_pretrained(path)
    return path


@pytest.fixture(scope='module')
def smolvlm(tmp_path_factory) -> str:
    return save_tiny_smolvlm('smolvlm', str(tmp_path_factory.mktemp('smolvlm')))


@pytest.fixture(scope='module', params=['smolvlm', 'idefics3'])
def family(request, smolvlm, tmp_path_factory) -> str:
    """Both architectures (the same model under two names); the engine's other checks run on SmolVLM alone."""
    if request.param == 'smolvlm':
        return smolvlm
    return save_tiny_smolvlm(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def prompts(smolvlm) -> list[ProcessedPrompt]:
    return [make_processor(smolvlm).process(prompt) for prompt in PROMPTS]


def hf_inputs(prompt: ProcessedPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs: the prompt's ids and the tiles of all its images, in order, as one image each."""
    ids = torch.tensor([prompt.input_ids])
    tiles = [m.data['pixel_values'] for m in prompt.multimodal]
    pixels = {'pixel_values': torch.cat(tiles)[None]} if tiles else {}
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels)


def test_spans_are_those_of_transformers_processor(family):
    """Each ``<image>`` the chat template writes becomes the text transformers' ``Idefics3Processor`` writes for the
    image's tiles (SmolVLM's writes the same), tokenized as transformers tokenizes the whole prompt, with its
    pixels."""
    tokenizer = AutoTokenizer.from_pretrained(family)
    reference = Idefics3Processor(PROCESSORS['idefics3'][1].from_pretrained(family), tokenizer, image_seq_len=4)
    processor = make_processor(family)
    for prompt, grids in zip(PROMPTS[1:], [[(2, 2)], [(2, 2), (2, 1)]]):
        processed, text = processor.process(prompt), processor.render(prompt, images=[])
        expected = reference(text=text, images=[prompt[1] if isinstance(prompt[1], list) else [prompt[1]]],
                             return_tensors='pt', add_special_tokens=False)
        assert processed.input_ids == expected['input_ids'][0].tolist()
        torch.testing.assert_close(torch.cat([m.data['pixel_values'] for m in processed.multimodal]),
                                   expected['pixel_values'][0], rtol=0, atol=0)
        assert [tuple(m.data['image_grid'][0].tolist()) for m in processed.multimodal] == grids
        image_rows = [i for m in processed.multimodal for i in range(m.offset, m.end) if m.data['placeholder_mask']
                      [i - m.offset]]
        assert image_rows == torch.nonzero(expected['input_ids'][0] == processor.image_inputs.image_token_id
                                           ).flatten().tolist()


def test_string_contents_keep_their_text(family):
    """The hub's template reads every content as a list of parts: a string content (a text prompt, a system
    message) rendered as it is lost its text; it goes in as one text part."""
    processor = make_processor(family)
    assert processor.render('plain text') == '<|im_start|>User: plain text<end_of_utterance>\nAssistant:'
    messages = [{'role': 'system', 'content': 'be brief'},
                {'role': 'user', 'content': [{'type': 'image', 'image': IMAGES[0]}, {'type': 'text', 'text': 'what?'}]}]
    assert processor.render(messages, images=[]) == ('<|im_start|>System: be brief<end_of_utterance>\nUser:<image>what?'
                                                     '<end_of_utterance>\nAssistant:')


def test_greedy_and_first_logits_match_transformers(family):
    prompts = [make_processor(family).process(prompt) for prompt in PROMPTS]
    outs = assert_vl_matches_transformers(family, hf_vl_model(family), prompts, [hf_inputs(p) for p in prompts])
    assert len({tuple(out) for out in outs}) == 3, 'the images must change the answer'
    assert len(set(outs[1])) > 2, 'the tiny model must not repeat one token'


@pytest.mark.slow
def test_batched_chunked_and_cached_equal_solo(smolvlm, prompts):
    """Chunks of 7 tokens and blocks of 4 tokens would end inside the images' spans."""
    assert_batched_chunked_and_cached_equal_solo(smolvlm, prompts,
                                                 chunked={'block_size': 4, 'max_prefill_token_num': 7},
                                                 cached={'block_size': 4}, warm=slice(1, None))


def test_spans_that_do_not_fit_their_tiles_are_refused(smolvlm, prompts):
    """A mask of other <image> tokens than the span holds, or of other than 4 per tile, is a clear error, and the
    request is not queued."""
    engine = make_engine(smolvlm)
    prompt = prompts[1]
    image = prompt.multimodal[0]
    shifted = MultiModalInput(image.offset + 1, image.length, image.content_hash, image.data)
    with pytest.raises(ValueError, match='its own span'):
        engine.add_request(prompt.input_ids, None, [shifted])
    fewer_tiles = {**image.data, 'pixel_values': image.data['pixel_values'][1:]}
    with pytest.raises(ValueError, match='an image of 4 tiles takes 16 <image> tokens'):
        engine.add_request(prompt.input_ids, None, [MultiModalInput(image.offset, image.length, 'x', fewer_tiles)])
    with pytest.raises(ValueError, match="'placeholder_mask'"):
        engine.add_request(prompt.input_ids, None, [MultiModalInput(
            image.offset, image.length, 'x', {'pixel_values': image.data['pixel_values']})])
    assert not engine.sequences


@pytest.fixture(scope='module')
def vl_server(smolvlm):
    yield from serve(tiny_engine(smolvlm), model_name='tiny-vl')


@pytest.mark.slow
def test_server_chat_with_a_data_url_image_matches_transformers(vl_server, smolvlm):
    """One request through the OpenAI server (the ``openai`` client) with a base64 image_url."""
    prompt = assert_image_chat_matches_transformers(vl_server, hf_vl_model(smolvlm), hf_inputs, IMAGES[0])
    assert prompt.multimodal


def test_bad_images_are_400_and_leave_nothing_held(vl_server):
    """Broken bytes, more images than a prompt may hold and an image without pixels are 400s with an OpenAI-style
    body; a 1 x 150 image (its tiles upscaled from one pixel column) is answered; nothing stays held."""
    client = openai.OpenAI(base_url=f'{vl_server.url}/v1', api_key='none', max_retries=0)
    full = png_bytes(IMAGES[0])
    too_many = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': data_url(IMAGES[1])}}] * 17}]
    for messages in [image_message(data_url(full[:len(full) // 2])), image_message(data_url(b'not an image')),
                     too_many]:
        with pytest.raises(openai.BadRequestError) as error:
            chat(client, messages)
        assert error.value.body['param'] == 'messages'
    assert chat(client, image_message(data_url(png_bytes(Image.new('RGB', (1, 150)))))).choices[0].message.content
    metrics = vl_server.metrics()
    assert metrics['lmdeploy:num_requests_running'] == 0 and metrics['lmdeploy:kv_cache_usage_perc'] == 0


@pytest.mark.slow
def test_tp2_equals_tp1(smolvlm, prompts):
    """The tower and connector run replicated on both ranks; each image's tiles and mask reach rank 1."""
    assert_tp2_equals_tp1(smolvlm, prompts)


def test_language_model_runs_in_the_native_decoder_stack(smolvlm, prompts, native_gemms):
    """bf16 on packed weights: the Llama layers run in the native decoder stack, image steps included, as the layers'
    own forward runs them."""
    engine = Engine(smolvlm, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None
    outs = run(engine, prompts)
    model.native_stack = None
    assert run(engine, prompts) == outs
