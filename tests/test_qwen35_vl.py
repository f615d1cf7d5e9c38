"""Qwen3.5 and Qwen3.5-MoE with images (the hub's ``Qwen3_5(Moe)ForConditionalGeneration``) against transformers on
tiny random models saved by transformers: 32 greedy tokens and first-step logits in fp32 on a text prompt and on one-
and two-image prompts; image and text requests batched, in prefill chunks that cut through the images and preempted
equal to solo runs, with prefix caching, asked for, still off; every request's KV blocks and recurrent-state slot
given back (also on abort); bf16 close to transformers; the pipeline answering OpenAI messages with a data-URL image as transformers does; and
the interleaved M-RoPE at the checkpoints' size."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from family_checks import assert_slots_free, assert_vl_matches_transformers, first_step_logits
from helpers import make_engine, run
from test_vl import data_url
from test_vl_families import IMAGES, PROMPTS, hf_inputs, make_processor
from transformers import AutoModelForImageTextToText, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from vl_models import hf_vl_model, save_tiny_vl_model

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy.archs import get_task
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding
from lmdeploy.vl.processor import ProcessedPrompt


@pytest.fixture(scope='module', params=['qwen3_5', 'qwen3_5_moe'])
def qwen3_5_vl(request, tmp_path_factory) -> str:
    return save_tiny_vl_model(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def prompts(qwen3_5_vl) -> list[ProcessedPrompt]:
    return [make_processor(qwen3_5_vl).process(prompt) for prompt in PROMPTS]


@pytest.fixture(scope='module')
def hf_model(qwen3_5_vl):
    return hf_vl_model(qwen3_5_vl)


def test_served_as_vision_language_models():
    assert get_task('Qwen3_5ForConditionalGeneration') == get_task('Qwen3_5MoeForConditionalGeneration') == 'vlm'


def test_greedy_and_first_logits_match_transformers(qwen3_5_vl, prompts, hf_model):
    assert [len(p.multimodal) for p in prompts] == [0, 1, 2]
    outs = assert_vl_matches_transformers(qwen3_5_vl, hf_model, prompts, [hf_inputs(hf_model, p) for p in prompts])
    assert outs[0] != outs[1] != outs[2], 'the images must change the answer'


def test_batched_chunked_and_preempted_equal_solo(qwen3_5_vl, prompts):
    """Image and text requests batched, in prefill chunks of 5 tokens (which cut through every image; the recurrent
    state carries over between them), preempted (recomputed from zero, images encoded again) and with prefix
    caching asked for (off: cached KV blocks cannot restore a recurrent state) give the solo tokens, and every
    request gives back its KV blocks and state slot."""
    mixed = [prompts[1], prompts[0], prompts[2], prompts[1]]
    solo = [run(make_engine(qwen3_5_vl), [p])[0] for p in mixed]
    engines = {'batched': make_engine(qwen3_5_vl),
               'chunked': make_engine(qwen3_5_vl, block_size=4, max_prefill_token_num=5, max_batch_size=4),
               'preempted': make_engine(qwen3_5_vl, block_size=4, num_gpu_blocks=22),
               'prefix caching': make_engine(qwen3_5_vl, block_size=4, enable_prefix_caching=True)}
    for name, engine in engines.items():
        assert run(engine, mixed) == solo, name
        assert_slots_free(engine)
    assert engines['preempted'].scheduler.num_preemptions > 0
    cached = engines['prefix caching']
    assert not cached.block_manager.enable_prefix_caching
    assert run(cached, mixed) == solo and cached.block_manager.num_hits == 0


def test_aborted_image_request_gives_back_its_blocks_and_slot(qwen3_5_vl, prompts):
    engine = make_engine(qwen3_5_vl, block_size=4, max_prefill_token_num=5)
    config = GenerationConfig(max_new_tokens=20)
    ids = [engine.add_request(p.input_ids, config, p.multimodal) for p in prompts[1:]]
    engine.step()
    engine.step()
    assert engine.scheduler.state_pool.num_free < engine.scheduler.state_pool.num_slots
    engine.abort(ids[1])
    while engine.has_unfinished():
        engine.step()
    assert_slots_free(engine)


def test_pipeline_answers_a_data_url_image_like_transformers(qwen3_5_vl, hf_model):
    """An OpenAI message with an image (refused while the vision tower was not loaded) gets transformers' tokens."""
    messages = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': data_url(IMAGES[2])}},
                                             {'type': 'text', 'text': 'describe'}]}]
    with pipeline(qwen3_5_vl, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16),
                  show_progress=False) as pipe:
        out = pipe(messages, gen_config=GenerationConfig(max_new_tokens=12, ignore_eos=True))
        prompt = pipe.async_engine.processor.process(messages)
    assert out.finish_reason == 'length' and len(prompt.multimodal) == 1
    expected = hf_model.generate(**hf_inputs(hf_model, prompt), max_new_tokens=12, do_sample=False, top_k=None,
                                 top_p=None, temperature=None)[0, len(prompt.input_ids):]
    assert out.token_ids == expected.tolist()


def test_bf16_close_to_transformers(qwen3_5_vl, prompts, hf_model):
    """bf16 on the CPU (the vision tower cast with the language model): the first step's logits differ from
    transformers' in fp32 by at most twice what transformers' own bf16 model does."""
    engine = Engine(qwen3_5_vl, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    assert engine.runner.model.visual.patch_embed.proj.weight.dtype == torch.bfloat16
    hf_bf16 = AutoModelForImageTextToText.from_pretrained(qwen3_5_vl, dtype=torch.bfloat16).eval()
    logits = first_step_logits(engine, prompts)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            ref = hf_model(**hf_inputs(hf_model, prompt)).logits[0, -1]
            hf_row = hf_bf16(**hf_inputs(hf_bf16, prompt)).logits[0, -1].float()
            assert (logits[row] - ref).abs().max() <= 2 * (hf_row - ref).abs().max()


@pytest.mark.parametrize('sections', [[11, 11, 10], None])
def test_interleaved_mrope_matches_transformers_at_qwen3_5_size(sections):
    """Qwen3.5's rotary at the checkpoints' size (a quarter of 256 features rotate: 32 frequencies, sections
    [11, 11, 10], also taken when the config names none), where the tiny models use [4, 2, 2] of 8."""
    rope = {'rope_type': 'default', 'rope_theta': 1e7, 'partial_rotary_factor': 0.25}
    if sections is not None:
        rope.update(mrope_section=sections, mrope_interleaved=True)
    config = Qwen3_5TextConfig(head_dim=256, rope_parameters=rope)
    positions = torch.randint(0, 4000, (3, 9))
    cos, sin = RotaryEmbedding(config, 256)(SimpleNamespace(positions=positions[0], rope_positions=positions),
                                            torch.float32)
    ref_cos, ref_sin = Qwen3_5TextRotaryEmbedding(config)(torch.zeros(1), positions[:, None])
    assert cos.shape == (9, 64)
    torch.testing.assert_close(cos, ref_cos[0])
    torch.testing.assert_close(sin, ref_sin[0])
