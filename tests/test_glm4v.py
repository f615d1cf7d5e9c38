"""GLM-4.1V-Thinking (``Glm4vForConditionalGeneration``) and GLM-4.5V / GLM-4.6V (``Glm4vMoeForConditionalGeneration``;
transformers' ``Glm46VForConditionalGeneration`` too) against transformers on tiny random models saved by transformers:
the prompt's tokens and pixels as transformers' ``Glm4vProcessor`` makes them, 32 greedy tokens and first-step logits
in fp32 on text, one-image and two-image prompts, batching, chunked prefill through images, prefix-cache hits, a
server chat whose image is a data URL, bad images answered 400 while the others go on, the M-RoPE over partial rotary
at the checkpoints' size (GLM-4.1V's neighbouring pairs, GLM-4.5V's halves) and ``tp=2``."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from family_checks import assert_batched_chunked_and_cached_equal_solo, assert_tp2_equals_tp1, \
    assert_vl_matches_transformers
from glm4v_models import save_tiny_glm4v
from helpers import make_engine, run
from PIL import Image
from server_helpers import serve, tiny_engine
from test_vl import data_url, png_bytes
from test_vl_families import IMAGES, PROMPTS, hf_inputs, make_processor
from test_vl_server import assert_image_chat_matches_transformers, image_message
from transformers import Glm4vTextConfig, Glm4vMoeTextConfig
from transformers.models.glm4v.modeling_glm4v import Glm4vTextRotaryEmbedding
from transformers.models.glm4v.modeling_glm4v import apply_rotary_pos_emb as glm4v_rotary
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextRotaryEmbedding
from transformers.models.glm4v_moe.modeling_glm4v_moe import apply_rotary_pos_emb as glm4v_moe_rotary
from vl_models import hf_vl_model

from lmdeploy.archs import get_task
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.models.glm4v import Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding, apply_rope
from lmdeploy.vl.processor import ProcessedPrompt


@pytest.fixture(scope='module', params=['glm4v', 'glm4v_moe'])
def glm4v(request, tmp_path_factory) -> str:
    return save_tiny_glm4v(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def prompts(glm4v) -> list[ProcessedPrompt]:
    return [make_processor(glm4v).process(prompt) for prompt in PROMPTS]


@pytest.fixture(scope='module')
def hf_model(glm4v):
    return hf_vl_model(glm4v)


def test_served_as_vision_language_models():
    assert {get_task(arch) for arch in ('Glm4vForConditionalGeneration', 'Glm4vMoeForConditionalGeneration',
                                        'Glm46VForConditionalGeneration')} == {'vlm'}


class ImageOnlyGlm4vProcessor(Glm4vProcessor):
    """transformers' processor without its video processor (which needs torchvision): images and text alone."""

    def check_argument_for_proper_class(self, argument_name, argument):
        return type(argument)


def test_prompt_tokens_and_pixels_are_those_of_transformers_processor(glm4v, prompts):
    """transformers' ``Glm4vProcessor`` (on the image processor the engine loads) writes each image's ``<|image|>``
    once per merged patch between the template's ``<|begin_of_image|>`` and ``<|end_of_image|>``."""
    processor = make_processor(glm4v)
    reference = ImageOnlyGlm4vProcessor(image_processor=processor.image_inputs.image_processor,
                                        tokenizer=processor.tokenizer.hf, video_processor=None)
    for prompt, processed in zip(PROMPTS[1:], prompts[1:]):
        images = prompt[1] if isinstance(prompt[1], list) else [prompt[1]]
        expected = reference(text=[processor.render(prompt, images=[])], images=images, return_tensors='pt')
        assert processed.input_ids == expected['input_ids'][0].tolist()
        assert torch.equal(torch.cat([m.data['pixel_values'] for m in processed.multimodal]),
                           expected['pixel_values'])
        assert torch.equal(torch.cat([m.data['image_grid_thw'] for m in processed.multimodal]),
                           expected['image_grid_thw'])
    assert [[m.length for m in p.multimodal] for p in prompts] == [[], [6], [4, 12]]


def test_greedy_and_first_logits_match_transformers(glm4v, prompts, hf_model):
    outs = assert_vl_matches_transformers(glm4v, hf_model, prompts, [hf_inputs(hf_model, p) for p in prompts])
    assert len(set(outs[0])) > 2, 'the tiny model must not repeat one token'
    assert outs[1] != outs[2], 'the images must change the answer'


def test_batched_chunked_and_cached_equal_solo(glm4v, prompts):
    # chunks of 5 tokens cut through every image; blocks of 4 end cached prefixes inside images
    assert_batched_chunked_and_cached_equal_solo(
        glm4v, prompts, chunked={'block_size': 4, 'max_prefill_token_num': 5}, cached={'block_size': 4},
        warm=slice(1, None))


@pytest.fixture
def glm4v_server(glm4v):
    yield from serve(tiny_engine(glm4v), model_name='tiny-vl')


def test_server_chat_with_a_data_url_image_matches_transformers(glm4v_server, hf_model):
    assert_image_chat_matches_transformers(glm4v_server, hf_model, lambda prompt: hf_inputs(hf_model, prompt),
                                           IMAGES[2])


def test_bad_images_are_400_and_others_go_on(glm4v_server):
    """Broken bytes, an image of 1 x 16000 pixels (the image processor's aspect bound is 200) and 17 images (16 at
    most) are answered 400 with an OpenAI error body; a 5 x 5 image (scaled up to one merged patch) and a good one
    are answered, and no request holds a KV block afterwards."""
    full = png_bytes(IMAGES[0])
    bad = {'could not decode': image_message(data_url(full[:len(full) // 2])),
           '200': image_message(data_url(Image.new('RGB', (1, 16000)))),
           'at most 16 images': [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {
               'url': data_url(IMAGES[1])}}] * 17}]}
    good = [image_message(data_url(Image.new('RGB', (5, 5), 'red'))), image_message(data_url(IMAGES[1]))]

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f'{glm4v_server.url}/v1', api_key='none', max_retries=0)
        calls = [client.chat.completions.create(model='tiny-vl', messages=m, max_tokens=8, temperature=0,
                                                extra_body={'ignore_eos': True}) for m in [*bad.values(), *good]]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run_all())
    for (message, _), result in zip(bad.items(), results):
        assert isinstance(result, openai.BadRequestError) and message in str(result)
    assert all(r.choices[0].finish_reason == 'length' for r in results[len(bad):])
    body = httpx.post(f'{glm4v_server.url}/v1/chat/completions',
                      json={'model': 'tiny-vl', 'messages': bad['could not decode']}).json()
    assert set(body['error']) == {'message', 'type', 'param', 'code'}
    metrics = glm4v_server.metrics()
    assert metrics['lmdeploy:num_requests_running'] == 0 and metrics['lmdeploy:kv_cache_usage_perc'] == 0


@pytest.mark.parametrize('kind', ['glm4v', 'glm4v_moe'])
def test_mrope_matches_transformers_at_the_checkpoints_size(kind):
    """GLM-4.1V's and GLM-4.5V's rotary (heads of 128 features, half of them rotating: 32 frequencies in the bands
    [8, 12, 12] transformers takes where the config names none) turn queries and keys so that their products are
    transformers' (GLM-4.1V turns neighbouring pairs, which the engine regroups into halves first)."""
    config_class, rotary, reference_apply, interleaved = {
        'glm4v': (Glm4vTextConfig, Glm4vTextRotaryEmbedding, glm4v_rotary, True),
        'glm4v_moe': (Glm4vMoeTextConfig, Glm4vMoeTextRotaryEmbedding, glm4v_moe_rotary, False)}[kind]
    config = config_class(hidden_size=4096, num_attention_heads=32,
                          rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0, 'partial_rotary_factor': 0.5})
    positions = torch.randint(0, 4000, (3, 9))
    cos, sin = RotaryEmbedding(config, 128)(SimpleNamespace(positions=positions[0], rope_positions=positions),
                                            torch.float32)
    ref_cos, ref_sin = rotary(config)(torch.zeros(1), positions[:, None])
    q, k = torch.randn(2, 9, 1, 128, dtype=torch.float64).float()
    ref_q, ref_k = reference_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    ours = (apply_rope(q, cos, sin, interleaved) * apply_rope(k, cos, sin, interleaved)).sum(-1)
    torch.testing.assert_close(ours, (ref_q[0] * ref_k[0]).sum(-1).transpose(0, 1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('kind, served_as', [('glm46v', Glm4vForConditionalGeneration),
                                              ('glm46v_moe', Glm4vMoeForConditionalGeneration)])
def test_glm46v_config_is_served_as_its_language_models_family(kind, served_as, tmp_path):
    """transformers' ``Glm46VForConditionalGeneration`` (its text model named by ``text_config``: GLM-4.1V's or
    GLM-4.5's) is the same model: served by the class of its language model, with transformers' tokens."""
    path = save_tiny_glm4v(kind, str(tmp_path / kind))
    engine = make_engine(path)
    assert type(engine.runner.model) is served_as
    prompt = make_processor(path).process(PROMPTS[1])
    hf_model = hf_vl_model(path)
    expected = hf_model.generate(**hf_inputs(hf_model, prompt), max_new_tokens=32, do_sample=False, top_k=None,
                                 top_p=None, temperature=None)[0, len(prompt.input_ids):]
    assert run(engine, [prompt]) == [expected.tolist()]


@pytest.mark.slow
def test_tp2_equals_tp1(glm4v, prompts):
    """Two ranks (gloo on the CPU): the language model sharded, the vision tower whole on each."""
    assert_tp2_equals_tp1(glm4v, prompts)


@pytest.mark.parametrize('kind', ['glm4v', 'glm4v_moe'])
def test_language_model_runs_in_the_native_decoder_stack(kind, tmp_path, native_gemms):
    """bf16 on packed weights: GLM-4.1V's layers (neighbouring pairs rotate, outputs normalized) and GLM-4.5V's (MoE
    blocks) run in the native decoder stack on the prompts' 3-D positions, with their own forward's tokens."""
    path = save_tiny_glm4v(kind, str(tmp_path / kind))
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16), show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None
    prompts = [make_processor(path).process(prompt) for prompt in PROMPTS]
    outs = run(engine, prompts)
    model.native_stack = None
    assert run(engine, prompts) == outs
