"""InternVL 3 (with a Qwen2 and with a Llama language model), Qwen3-VL and Qwen3-VL-MoE against transformers
on tiny random models saved by transformers: 32 greedy tokens and first-step logits in fp32 on a text prompt
and on one- and two-image prompts (images of different sizes), InternVL's image spans, batching, chunked
prefill through images, prefix-cache hits, the server answering a chat whose image is a data URL,
Qwen3-VL-MoE's two layouts of stacked experts, and InternVL's language model in the native decoder stack.
test_vl.py runs its pipeline checks (OpenAI messages with data URLs, bad images, preemption) on InternVL and
Qwen3-VL too."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from family_checks import assert_batched_chunked_and_cached_equal_solo, assert_vl_matches_transformers
from helpers import make_engine, run
from server_helpers import serve, tiny_engine
from test_vl_server import assert_image_chat_matches_transformers
from transformers import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding
from vl_models import INTERNVL_TOKENS, hf_vl_inputs, hf_vl_model, make_processor, random_image, save_tiny_vl_model

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding
from lmdeploy.vl.processor import ProcessedPrompt

IMAGES = [random_image(1), random_image(2, (60, 60)), random_image(3, (150, 100))]
PROMPTS = ['plain text', ('describe', IMAGES[0]), ('compare', [IMAGES[1], IMAGES[2]])]


@pytest.fixture(scope='module', params=['internvl', 'internvl_llama', 'qwen3_vl', 'qwen3_vl_moe'])
def vl_family(request, tmp_path_factory) -> str:
    return save_tiny_vl_model(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def prompts(vl_family) -> list[ProcessedPrompt]:
    return [make_processor(vl_family).process(prompt) for prompt in PROMPTS]


@pytest.fixture(scope='module')
def hf_model(vl_family):
    return hf_vl_model(vl_family)


def hf_inputs(model, prompt: ProcessedPrompt) -> dict[str, torch.Tensor]:
    return hf_vl_inputs(model, prompt.input_ids, [image.data for image in prompt.multimodal])


def test_greedy_and_first_logits_match_transformers(vl_family, prompts, hf_model):
    outs = assert_vl_matches_transformers(vl_family, hf_model, prompts, [hf_inputs(hf_model, p) for p in prompts])
    assert outs[1] != outs[2], 'the images must change the answer'


def test_batched_chunked_and_cached_equal_solo(vl_family, prompts):
    # chunks of 5 tokens cut through every image (and through InternVL's tiles); the image prompts are cached
    assert_batched_chunked_and_cached_equal_solo(
        vl_family, prompts, chunked={'block_size': 4, 'max_prefill_token_num': 5}, cached={'block_size': 4},
        warm=slice(1, None))


@pytest.fixture
def vl_server(vl_family):
    yield from serve(tiny_engine(vl_family), model_name='tiny-vl')


def test_server_chat_with_a_data_url_image_matches_transformers(vl_server, hf_model):
    assert_image_chat_matches_transformers(vl_server, hf_model, lambda prompt: hf_inputs(hf_model, prompt),
                                           IMAGES[2])


def test_internvl_image_spans_follow_its_processor(tmp_path):
    """Each image's run of context tokens, between <img> and </img>, has 4 tokens (a 56 px tile of 14 px
    patches, pixel-shuffled) per tile: those of the image processor's crop_to_patches plus a thumbnail."""
    path = save_tiny_vl_model('internvl', str(tmp_path / 'internvl'))
    processor = make_processor(path)
    image_processor = processor.image_inputs.image_processor
    images = PROMPTS[2][1]
    start, context, end = (INTERNVL_TOKENS[name] for name in ('start_image_token', 'context_image_token',
                                                             'end_image_token'))
    tiles = [image_processor.get_number_of_image_patches(image.height, image.width, {'crop_to_patches': True})
             for image in images]
    parts = processor.render(PROMPTS[2], images=[]).split(context)
    text = parts[0] + ''.join(start + context * 4 * n + end + part for n, part in zip(tiles, parts[1:]))
    expected = processor.tokenizer.encode(text, add_special_tokens=False)
    processed = processor.process(PROMPTS[2])
    assert processed.input_ids == expected
    assert tiles == [1, 5]  # 60 x 60 fits one tile; 150 x 100 takes 2 x 2 and a thumbnail
    assert [len(image.data['pixel_values']) for image in processed.multimodal] == tiles


def test_qwen3_vl_moe_loads_the_hubs_stacked_expert_layout(tmp_path):
    """transformers 5 saves stacked experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I]; the hub's
    checkpoints hold them transposed. Both load to the same model."""
    path = save_tiny_vl_model('qwen3_vl_moe', str(tmp_path / 'saved'))
    hub = shutil.copytree(path, tmp_path / 'hub')
    for file in hub.glob('*.safetensors'):
        tensors = load_file(file)
        stacked = [name for name in tensors if name.endswith(('experts.gate_up_proj', 'experts.down_proj'))]
        assert stacked
        save_file({name: t.transpose(1, 2).contiguous() if name in stacked else t for name, t in tensors.items()},
                  file, metadata={'format': 'pt'})
    prompts = [make_processor(path).process(PROMPTS[1])]
    assert run(make_engine(str(hub)), prompts) == run(make_engine(path), prompts)


@pytest.mark.parametrize('kind', ['internvl', 'qwen3_vl', 'qwen3_vl_moe'])
def test_language_model_runs_in_the_native_decoder_stack(kind, tmp_path, native_gemms):
    """bf16 on packed weights: InternVL's Qwen2 layers and Qwen3-VL's (q/k norms; its image steps add the
    deepstack features in the layers' own forward; Qwen3-VL-MoE's sparse layers as MoE blocks) run in the native
    decoder stack, as their own forward does."""
    config = PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16)
    path = save_tiny_vl_model(kind, str(tmp_path / kind))
    engine = Engine(path, config, show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None
    prompts = [make_processor(path).process(prompt) for prompt in PROMPTS]
    outs = run(engine, prompts)
    model.native_stack = None
    assert run(engine, prompts) == outs


def test_interleaved_mrope_matches_transformers_at_qwen3_vl_size():
    """Qwen3-VL's own sections ([24, 20, 20] of 64 frequencies), where the tiny models use [4, 2, 2] of 8."""
    config = Qwen3VLTextConfig(head_dim=128, rope_parameters={'rope_type': 'default', 'rope_theta': 5e6,
                                                              'mrope_section': [24, 20, 20]})
    positions = torch.randint(0, 4000, (3, 9))
    cos, sin = RotaryEmbedding(config, 128)(SimpleNamespace(positions=positions[0], rope_positions=positions),
                                            torch.float32)
    ref_cos, ref_sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1), positions[:, None])
    torch.testing.assert_close(cos, ref_cos[0])
    torch.testing.assert_close(sin, ref_sin[0])
