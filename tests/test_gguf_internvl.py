"""InternVL 3 (Qwen2 and Llama language models) from llama.cpp's two GGUF files. llama.cpp converts OpenGVLab's
remote-code layout (``vision_model.*``, ``mlp1.*``, ``language_model.*``): each tiny random transformers model is
put in that layout and written as convert_hf_to_gguf.py writes it (a plain ``qwen2``/``llama`` language model;
with ``--mmproj``, projector ``internvl``: q/k/v split, layer scales as ``.weight``, gguf-py's tensor name map),
then served token for token like the safetensors original on image prompts; the errors name what the files
lack."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from test_gguf import finish, llama_permute
from test_gguf_vl import IMAGES, _tokenizer, assert_serves_like_the_original, converted_tensors
from test_vl_families import make_processor
from transformers import AutoConfig
from vl_models import INTERNVL_VISION, save_tiny_vl_model

from lmdeploy.pytorch.weights.gguf import resolve_gguf

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

# a 150 x 100 image takes 2 x 2 tiles and a thumbnail
PROMPTS = ['plain text', ('describe', IMAGES[0]), ('compare', [IMAGES[1], IMAGES[2]])]
# transformers' InternVL names -> the remote-code checkpoints' (transformers' convert_internvl_weights_to_hf.py
# in reverse); the tower's q/k/v stay split, as the converter splits the remote code's fused qkv
REMOTE_CODE_NAMES = [
    (r'^vision_tower\.', 'vision_model.'), (r'\.layer\.', '.layers.'), (r'cls_token', 'class_embedding'),
    (r'position_embeddings', 'position_embedding'), (r'patch_embeddings\.projection', 'patch_embedding'),
    (r'lambda_(\d)', r'ls\1'), (r'attention\.projection_layer', 'attn.proj'), (r'attention\.', 'attn.'),
    (r'layernorm_before', 'norm1'), (r'layernorm_after', 'norm2'), (r'^multi_modal_projector\.layer_norm', 'mlp1.0'),
    (r'^multi_modal_projector\.linear_1', 'mlp1.1'), (r'^multi_modal_projector\.linear_2', 'mlp1.3'),
    (r'^lm_head\.', 'language_model.lm_head.')]


def remote_code_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """The tiny transformers model's tensors under the remote-code checkpoints' names."""
    out = {}
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        for pattern, replacement in REMOTE_CODE_NAMES:
            name = re.sub(pattern, replacement, name)
        out[name] = value
    return out


def write_text_gguf(model_dir: str, out: Path) -> None:
    """The language model as convert_hf_to_gguf.py's Qwen2Model / LlamaModel writes it (float32)."""
    config = AutoConfig.from_pretrained(model_dir).text_config
    arch = config.model_type
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters['rope_theta'])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == 'llama':
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    _tokenizer(model_dir, writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    heads = {'q_proj': config.num_attention_heads, 'k_proj': config.num_key_value_heads}
    for name, value in remote_code_state_dict(model_dir).items():
        if not name.startswith('language_model.'):
            continue
        name = name.removeprefix('language_model.')
        module = name.split('.')[-2]
        if arch == 'llama' and module in heads:
            value = torch.from_numpy(llama_permute(value.numpy(), heads[module]))
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), value.contiguous().numpy())
    finish(writer)


def write_mmproj(model_dir: str, out: Path) -> None:
    """The tower and projector as convert_hf_to_gguf.py ``--mmproj`` (InternVisionModel) writes them (float32)."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    writer = gguf.GGUFWriter(str(out), 'clip')
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_vision_projection_dim(config.text_config.hidden_size)
    writer.add_vision_image_size(vision.image_size[0])
    writer.add_vision_patch_size(vision.patch_size[0])
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(vision.num_hidden_layers)
    writer.add_vision_head_count(vision.num_attention_heads)
    processor = json.loads(Path(model_dir, 'preprocessor_config.json').read_text())
    writer.add_vision_image_mean(processor['image_mean'])
    writer.add_vision_image_std(processor['image_std'])
    writer.add_clip_projector_type(gguf.VisionProjectorType.INTERNVL)
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    writer.add_vision_projector_scale_factor(int(1 / config.downsample_ratio))
    writer.add_vision_preproc_min_tiles(processor['min_patches'])
    writer.add_vision_preproc_max_tiles(processor['max_patches'])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, value in remote_code_state_dict(model_dir).items():
        if name.startswith('language_model.'):
            continue
        name = re.sub(r'attn\.([qkv])_proj', r'self_attn.\1_proj', name)
        if name.startswith('vision_model.'):
            name = f'vision_tower.{name}'
        if re.search(r'\.ls\d$|position_embedding$', name):
            name += '.weight'
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), value.contiguous().numpy())
    finish(writer)


# the hub's InternViT-300M (q/k/v with biases, LayerNorms) with each language model, and an InternViT-6B-like tower
# (RMS norms without biases, q/k norms)
TOWERS = {'internvl': ('internvl', {'attention_bias': True}),
          'internvl_llama': ('internvl_llama', {'attention_bias': True}),
          'internvl_6b_tower': ('internvl', {'norm_type': 'rms_norm', 'use_qk_norm': True})}


@pytest.fixture(scope='module', params=list(TOWERS))
def internvl(request, tmp_path_factory) -> str:
    kind, tower = TOWERS[request.param]
    # llama.cpp's map names the projector's layers as blocks of the tower: its mlp1.3 needs a depth of 4 or more
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {'num_hidden_layers': 4, **tower}.items():
            patch.setitem(INTERNVL_VISION, name, value)
        path = save_tiny_vl_model(kind, str(tmp_path_factory.mktemp(request.param)))
    # llama.cpp feeds the tower's last layer to the projector (its mmproj keeps no other), as the hub's models do
    config = json.loads(Path(path, 'config.json').read_text())
    Path(path, 'config.json').write_text(json.dumps({**config, 'vision_feature_layer': -1}))
    return path


@pytest.fixture(scope='module')
def gguf_pair(internvl, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_text_gguf(internvl, folder / 'InternVL3-tiny-F32.gguf')
    write_mmproj(internvl, folder / 'mmproj-InternVL3-tiny-F32.gguf')
    return folder


def test_gguf_pair_serves_image_prompts_like_the_original(internvl, gguf_pair):
    model = str(gguf_pair / 'InternVL3-tiny-F32.gguf')
    folder = resolve_gguf(model)
    original = {re.sub(r'^language_model\.', '', name): value
                for name, value in load_file(f'{internvl}/model.safetensors').items()}
    converted = converted_tensors(folder)
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], value) for name, value in original.items())
    _, from_gguf = assert_serves_like_the_original(internvl, model, folder)
    assert [len(image.data['pixel_values']) for image in from_gguf[2].multimodal] == [1, 5]


# the remote-code checkpoints' kind of chat template (kept in llama.cpp's text file): contents joined as strings
STRING_CONTENT_TEMPLATE = ("{% for m in messages %}"
                           "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_of_string_contents_gets_each_image_as_its_line(internvl, gguf_pair, tmp_path):
    """An image part reaches such a template as ``<IMG_CONTEXT>\\n``, as transformers' InternVL template writes
    it: the prompts' ids are the original's."""
    model_dir = shutil.copytree(internvl, tmp_path / 'remote-code')
    (model_dir / 'chat_template.jinja').write_text(STRING_CONTENT_TEMPLATE)
    folder = tmp_path / 'gguf'
    folder.mkdir()
    write_text_gguf(str(model_dir), folder / 'InternVL3-tiny-F32.gguf')
    shutil.copy(gguf_pair / 'mmproj-InternVL3-tiny-F32.gguf', folder)
    processor = make_processor(resolve_gguf(str(folder / 'InternVL3-tiny-F32.gguf')))
    assert processor.tokenizer.hf.chat_template == STRING_CONTENT_TEMPLATE
    expected = [make_processor(internvl).process(prompt).input_ids for prompt in PROMPTS]
    assert [processor.process(prompt).input_ids for prompt in PROMPTS] == expected


def _edit_mmproj(source: Path, out: Path, drop_key: str | None = None) -> None:
    """A copy of the mmproj ``source`` without the metadata ``drop_key``."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), 'clip')
    for field in reader.fields.values():
        if field.name in (drop_key, 'general.architecture') or field.name.startswith('GGUF.'):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data)
    finish(writer)


def test_errors_name_what_the_files_lack(internvl, gguf_pair, tmp_path):
    model = tmp_path / 'model.gguf'
    shutil.copy(gguf_pair / 'InternVL3-tiny-F32.gguf', model)
    mmproj = gguf_pair / 'mmproj-InternVL3-tiny-F32.gguf'
    for key, message in [('clip.vision.projector.scale_factor', 'missing GGUF metadata: clip.vision.projector'),
                         ('clip.vision.image_size', 'missing GGUF metadata: clip.vision.image_size'),
                         ('clip.use_gelu', 'must set one of clip.use_gelu, clip.use_silu')]:
        _edit_mmproj(mmproj, tmp_path / 'mmproj-x.gguf', key)
        with pytest.raises(ValueError, match=message):
            resolve_gguf(str(model))
    shutil.copy(mmproj, tmp_path / 'mmproj-x.gguf')
    reader = gguf.GGUFReader(str(model), 'r+')
    tokens = reader.fields['tokenizer.ggml.tokens']
    token = next(i for i in tokens.data if bytes(tokens.parts[i]) == b'</img>')
    tokens.parts[token][:] = ord('x')  # a token of the same length
    del reader
    with pytest.raises(ValueError, match='the tokenizer has no </img> token'):
        resolve_gguf(str(model))


def test_a_text_file_beside_two_mmprojs_is_a_text_model_with_a_warning(gguf_pair, tmp_path, caplog):
    """Which of two mmproj files goes with the model cannot be told: the file is served as the text model it is,
    and a warning says why."""
    model = tmp_path / 'model.gguf'
    shutil.copy(gguf_pair / 'InternVL3-tiny-F32.gguf', model)
    for name in ('mmproj-a.gguf', 'mmproj-b.gguf'):
        shutil.copy(gguf_pair / 'mmproj-InternVL3-tiny-F32.gguf', tmp_path / name)
    with caplog.at_level('WARNING'):
        folder = resolve_gguf(str(model))
    config = json.loads((Path(folder) / 'config.json').read_text())
    assert config['architectures'] in (['Qwen2ForCausalLM'], ['LlamaForCausalLM'])
    assert 'served as a text model' in caplog.text and '2 of them' in caplog.text
