"""Mistral Small 4 as the hub ships it (``Mistral3ForConditionalGeneration`` with a ``mistral4`` language model:
Pixtral tower and Mistral 3's projector feeding DeepSeek-V3-style latent attention and experts) against transformers
on a tiny random model saved by transformers: 32 greedy tokens and first-step logits in fp32 on text, one-image and
two-image prompts, batching, chunked prefill through images, prefix-cache hits on the same images, a server chat
whose image is a data URL and two tensor-parallel ranks. The image path (processor, spans, hostile images) is
Mistral 3's, tested there."""
from __future__ import annotations

import openai
import pytest
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_tp2_equals_tp1,
                           assert_vl_matches_transformers)
from helpers import make_engine
from server_helpers import serve, tiny_engine
from test_mistral3_vl import IMAGES, PROMPT_IMAGES, PROMPTS, hf_inputs
from test_vl import data_url
from test_vl_families import make_processor
from test_vl_server import chat, image_message
from vl_models import hf_vl_model, save_tiny_vl_model

from lmdeploy.pytorch.models.mistral4_vl import MistralSmall4ForConditionalGeneration
from lmdeploy.vl.processor import ProcessedPrompt


@pytest.fixture(scope='module')
def mistral_small4(tmp_path_factory) -> str:
    return save_tiny_vl_model('mistral3_mistral4', str(tmp_path_factory.mktemp('mistral_small4')))


@pytest.fixture(scope='module')
def prompts(mistral_small4) -> list[ProcessedPrompt]:
    return [make_processor(mistral_small4).process(prompt) for prompt in PROMPTS]


@pytest.fixture(scope='module')
def hf_model(mistral_small4):
    return hf_vl_model(mistral_small4)


def test_greedy_and_first_logits_match_transformers(mistral_small4, prompts, hf_model):
    engine = make_engine(mistral_small4)
    assert isinstance(engine.runner.model, MistralSmall4ForConditionalGeneration)
    assert engine.runner.model.layers[0].self_attn.scaled_queries
    inputs = [hf_inputs(mistral_small4, prompt, images) for prompt, images in zip(prompts, PROMPT_IMAGES)]
    outs = assert_vl_matches_transformers(mistral_small4, hf_model, prompts, inputs)
    assert outs[1] != outs[2], 'the images must change the answer'


def test_batched_chunked_and_cached_equal_solo(mistral_small4, prompts):
    # chunks of 5 tokens cut through the images' rows; the image prompts are cached
    assert_batched_chunked_and_cached_equal_solo(
        mistral_small4, prompts, chunked={'block_size': 4, 'max_prefill_token_num': 5}, cached={'block_size': 4},
        warm=slice(1, None))


@pytest.fixture
def mistral_small4_server(mistral_small4):
    yield from serve(tiny_engine(mistral_small4), model_name='tiny-vl')


def test_server_chat_with_a_data_url_image_matches_transformers(mistral_small4_server, mistral_small4, hf_model):
    messages = image_message(data_url(IMAGES[2]))
    prompt = mistral_small4_server.engine.processor.process(messages)
    expected = hf_model.generate(**hf_inputs(mistral_small4, prompt, IMAGES[2:]), max_new_tokens=10, do_sample=False,
                                 top_k=None, top_p=None, temperature=None)[0, len(prompt.input_ids):]
    client = openai.OpenAI(base_url=f'{mistral_small4_server.url}/v1', api_key='none', max_retries=0)
    reply = chat(client, messages)
    assert reply.choices[0].message.content == mistral_small4_server.engine.tokenizer.decode(expected.tolist())


@pytest.mark.slow
def test_tp2_equals_tp1(mistral_small4, prompts):
    """Two ranks (gloo on the CPU): the language model's heads and experts split, the vision part whole on each."""
    assert_tp2_equals_tp1(mistral_small4, prompts)
