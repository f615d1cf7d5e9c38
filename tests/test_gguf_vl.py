"""Qwen2-VL and Qwen2.5-VL from llama.cpp's two GGUF files: a tiny random transformers model of each written as
convert_hf_to_gguf.py writes it (the language model as arch ``qwen2vl``; with ``--mmproj``, the tower as arch
``clip``: gguf-py's tensor name maps, q/k/v split, the Conv3d patch embedding split into two Conv2d halves) served
token for token like the safetensors original on image prompts, and the errors for a missing, doubled or
mismatched mmproj and one without the tower's shape."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from helpers import make_engine, run
from test_gguf import finish
from test_vl_families import make_processor
from transformers import AutoConfig, AutoTokenizer
from vl_models import QWEN25_VISION, QWEN_VISION, random_image, save_tiny_vl_model

from lmdeploy.pytorch.weights.gguf import resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

# sizes whose Qwen2-VL grids lie within both the tiny model's pixel limits and the image processor's defaults
IMAGES = [random_image(1), random_image(2, (60, 60)), random_image(3, (100, 80))]
PROMPTS = ['plain text', ('describe', IMAGES[0]), ('compare', [IMAGES[1], IMAGES[2]])]


def _tokenizer(model_dir: str, writer: gguf.GGUFWriter) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()}
    rows = AutoConfig.from_pretrained(model_dir).text_config.vocab_size  # the converter pads up to the embedding
    tokens = [vocab.get(i, f'[PAD{i}]') for i in range(rows)]
    writer.add_tokenizer_model('gpt2')
    writer.add_tokenizer_pre('qwen2')
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.UNUSED if i not in vocab else gguf.TokenType.CONTROL if t in special else
                            gguf.TokenType.NORMAL for i, t in enumerate(tokens)])
    merges = json.loads(Path(model_dir, 'tokenizer.json').read_text())['model']['merges']
    writer.add_token_merges([m if isinstance(m, str) else ' '.join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def add_qwen_vl_text_metadata(writer: gguf.GGUFWriter, text) -> None:
    """A Qwen-VL language model's shape, M-RoPE sections and norm epsilon, as the converter writes them."""
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_rope_dimension_sections([*text.rope_parameters['mrope_section'], 0])
    writer.add_rope_freq_base(text.rope_parameters['rope_theta'])
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)


def f32_mmproj_writer(out: Path) -> gguf.GGUFWriter:
    """A writer of an mmproj file with the header convert_hf_to_gguf.py ``--mmproj --outtype f32`` starts with."""
    writer = gguf.GGUFWriter(str(out), 'clip')
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    return writer


def vision_tower_metadata(writer: gguf.GGUFWriter, vision, projection_dim: int, image_mean: list[float],
                          image_std: list[float]) -> dict[str, tuple]:
    """The ``clip.vision.*`` keys every mmproj writer adds for a ViT tower, by name: ``(writer method, value)``."""
    return {'projection_dim': (writer.add_vision_projection_dim, projection_dim),
            'image_size': (writer.add_vision_image_size, vision.image_size),
            'patch_size': (writer.add_vision_patch_size, vision.patch_size),
            'embedding_length': (writer.add_vision_embedding_length, vision.hidden_size),
            'feed_forward_length': (writer.add_vision_feed_forward_length, vision.intermediate_size),
            'block_count': (writer.add_vision_block_count, vision.num_hidden_layers),
            'attention.head_count': (writer.add_vision_head_count, vision.num_attention_heads),
            'image_mean': (writer.add_vision_image_mean, image_mean),
            'image_std': (writer.add_vision_image_std, image_std)}


def write_qwen2vl_gguf(model_dir: str, out: Path) -> None:
    """The language model as convert_hf_to_gguf.py's Qwen2VLModel writes it (float32)."""
    config = AutoConfig.from_pretrained(model_dir).text_config
    writer = gguf.GGUFWriter(str(out), 'qwen2vl')
    add_qwen_vl_text_metadata(writer, config)
    _tokenizer(model_dir, writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, config.num_hidden_layers)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if not name.startswith('visual.'):
            writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), value.numpy())
    finish(writer)


def write_mmproj(model_dir: str, out: Path) -> None:
    """The vision tower as convert_hf_to_gguf.py ``--mmproj`` (Qwen2VLVisionModel) writes it (float32)."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    qwen25 = config.model_type == 'qwen2_5_vl'
    writer = gguf.GGUFWriter(str(out), 'clip')
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_vision_projection_dim(vision.out_hidden_size if qwen25 else vision.hidden_size)
    writer.add_vision_image_size(560)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size if qwen25 else vision.embed_dim)
    writer.add_vision_feed_forward_length(vision.intermediate_size if qwen25 else vision.embed_dim * vision.mlp_ratio)
    writer.add_vision_block_count(vision.depth)
    writer.add_vision_head_count(vision.num_heads)
    processor = json.loads(Path(model_dir, 'preprocessor_config.json').read_text())
    writer.add_vision_image_mean(processor['image_mean'])
    writer.add_vision_image_std(processor['image_std'])
    if qwen25:
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        writer.add_vision_use_silu(True)
        writer.add_vision_n_wa_pattern(vision.fullatt_block_indexes[0] + 1)
    else:
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
    writer.add_vision_attention_layernorm_eps(1e-6)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        if not name.startswith('visual.'):
            continue
        if name == 'visual.patch_embed.proj.weight':
            patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
            writer.add_tensor(f'{patch}.weight', value[:, :, 0].contiguous().numpy())
            writer.add_tensor(f'{patch}.weight.1', value[:, :, 1].contiguous().numpy())
            continue
        parts = zip(('q', 'k', 'v'), value.chunk(3)) if '.qkv.' in name else [(None, value)]
        for part, tensor in parts:
            hf_name = name.replace('qkv', part) if part else name
            writer.add_tensor(names.get_name(hf_name, try_suffixes=('.weight', '.bias')), tensor.contiguous().numpy())
    finish(writer)


@pytest.fixture(scope='module', params=['qwen2_vl', 'qwen2_5_vl'])
def qwen2_vl(request, tmp_path_factory) -> str:
    # llama.cpp's map names the merger's layers as blocks of the tower: its mlp.2 needs a depth of 3 or more;
    # its Qwen2.5-VL windows are 112 px, as the hub's models have them
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(QWEN_VISION, 'depth', 3)
        patch.setitem(QWEN25_VISION, 'depth', 3)
        patch.setitem(QWEN25_VISION, 'window_size', 112)
        return save_tiny_vl_model(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def gguf_pair(qwen2_vl, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_qwen2vl_gguf(qwen2_vl, folder / 'Qwen2-VL-tiny-F32.gguf')
    write_mmproj(qwen2_vl, folder / 'mmproj-Qwen2-VL-tiny-F32.gguf')
    return folder


def converted_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a converted folder's shards."""
    tensors = {}
    for shard in Path(folder).glob('*.safetensors'):
        tensors |= load_file(str(shard))
    return tensors


def assert_serves_like_the_original(original: str, model: str, folder: str) -> tuple[list, list]:
    """The converted pair's processor (``folder``) gives the original's input ids and image tensors on ``PROMPTS``,
    and the engine on the GGUF file ``model`` the original's greedy tokens, which the images change; returns both
    sides' processed prompts."""
    prompts = [make_processor(original).process(prompt) for prompt in PROMPTS]
    from_gguf = [make_processor(folder).process(prompt) for prompt in PROMPTS]
    assert [p.input_ids for p in from_gguf] == [p.input_ids for p in prompts]
    for ours, theirs in zip(from_gguf, prompts):
        for image, reference in zip(ours.multimodal, theirs.multimodal):
            assert all(torch.equal(image.data[key], reference.data[key]) for key in reference.data)
    expected = run(make_engine(original), prompts)
    assert run(make_engine(model), from_gguf) == expected
    assert expected[1] != expected[2], 'the images must change the answer'
    return prompts, from_gguf


def test_gguf_pair_serves_image_prompts_like_the_original(qwen2_vl, gguf_pair):
    model = str(gguf_pair / 'Qwen2-VL-tiny-F32.gguf')
    folder = resolve_gguf(model)
    original, converted = load_file(f'{qwen2_vl}/model.safetensors'), converted_tensors(folder)
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], value) for name, value in original.items())
    assert_serves_like_the_original(qwen2_vl, model, folder)


def test_mmproj_missing_doubled_mismatched_or_incomplete(gguf_pair, tmp_path):
    model = tmp_path / 'model.gguf'
    shutil.copy(gguf_pair / 'Qwen2-VL-tiny-F32.gguf', model)
    with pytest.raises(ValueError, match=r'exactly one mmproj\*\.gguf .* found none'):
        resolve_gguf(str(model))
    shutil.copy(gguf_pair / 'mmproj-Qwen2-VL-tiny-F32.gguf', tmp_path / 'mmproj-a.gguf')
    shutil.copy(gguf_pair / 'mmproj-Qwen2-VL-tiny-F32.gguf', tmp_path / 'mmproj-b.gguf')
    with pytest.raises(ValueError, match='found mmproj-a.gguf, mmproj-b.gguf'):
        resolve_gguf(str(model))
    (tmp_path / 'mmproj-b.gguf').unlink()
    reader = gguf.GGUFReader(str(tmp_path / 'mmproj-a.gguf'), 'r+')
    projector = reader.fields['clip.projector_type']
    projector.parts[projector.data[0]][:] = ord('x')  # a name of the same length
    del reader
    with pytest.raises(ValueError, match="projector 'x+' does not pair with a qwen2vl language model"):
        resolve_gguf(str(model))
    writer = gguf.GGUFWriter(str(tmp_path / 'mmproj-a.gguf'), 'clip')
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
    finish(writer)
    with pytest.raises(ValueError, match='missing GGUF metadata: clip.vision.embedding_length'):
        resolve_gguf(str(model))
