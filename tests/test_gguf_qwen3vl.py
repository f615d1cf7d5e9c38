"""Qwen3-VL and Qwen3-VL-MoE from llama.cpp's two GGUF files: a tiny random transformers model of each written as
convert_hf_to_gguf.py writes it (the language model as arch ``qwen3vl`` or ``qwen3vlmoe``, the MoE's stacked experts
as gate, up and down stacks; with ``--mmproj``, the tower as arch ``clip``: gguf-py's tensor name maps, q/k/v kept
fused, the Conv3d patch embedding split into two Conv2d halves, each deepstack merger named by the tower layer it
reads, here layers 0 and 2 of 3) served token for token, and with the same first-step logits, as the safetensors
original on image prompts; and the errors for a missing or mismatched mmproj."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors.torch import load_file
from family_checks import first_step_logits
from helpers import make_engine, run
from test_gguf import finish
from test_gguf_mixed import linear_formats
from test_gguf_vl import (PROMPTS, _tokenizer, add_qwen_vl_text_metadata, assert_serves_like_the_original,
                         converted_tensors)
from test_vl_families import make_processor
from transformers import AutoConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vl_models import QWEN3_MOE_TEXT, QWEN3_VISION, save_tiny_vl_model

from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf
from lmdeploy.pytorch.weights.gguf_vl.qwen3 import QWEN3_PIXELS

pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')

MODEL, MMPROJ = 'Qwen3-VL-tiny-F32.gguf', 'mmproj-Qwen3-VL-tiny-F32.gguf'


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """The saved tensors under the names llama.cpp's converter maps (``model.*``, ``visual.*``), the stacked
    experts (transformers 5's ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) as the converter writes them:
    ``gate_proj``, ``up_proj`` and ``down_proj`` stacks of ``[E, out, in]``."""
    tensors = {}
    for name, value in load_file(f'{model_dir}/model.safetensors').items():
        name = name.replace('model.language_model.', 'model.').replace('model.visual.', 'visual.')
        if name.endswith('.experts.gate_up_proj'):
            prefix = name.removesuffix('gate_up_proj')
            tensors[f'{prefix}gate_proj.weight'], tensors[f'{prefix}up_proj.weight'] = value.chunk(2, dim=1)
        elif name.endswith('.experts.down_proj'):
            tensors[f'{name}.weight'] = value
        else:
            tensors[name] = value
    return tensors


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The expert stacks of :func:`_checkpoint` one tensor per expert, as the converted folder holds them."""
    out = {}
    for name, value in tensors.items():
        prefix, stacked, tail = name.partition('.experts.')
        out |= {f'{prefix}.experts.{e}.{tail}': part for e, part in enumerate(value)} if stacked else {name: value}
    return out


def write_qwen3vl_gguf(model_dir: str, out: Path) -> None:
    """The language model as convert_hf_to_gguf.py's Qwen3VLTextModel (Qwen3VLMoeTextModel) writes it (float32)."""
    config = AutoConfig.from_pretrained(model_dir)
    text = config.text_config
    moe = config.model_type == 'qwen3_vl_moe'
    arch = gguf.MODEL_ARCH.QWEN3VLMOE if moe else gguf.MODEL_ARCH.QWEN3VL
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    add_qwen_vl_text_metadata(writer, text)
    if moe:
        writer.add_expert_count(text.num_experts)
        writer.add_expert_used_count(text.num_experts_per_tok)
        writer.add_expert_feed_forward_length(text.moe_intermediate_size)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_num_deepstack_layers(len(config.vision_config.deepstack_visual_indexes))
    _tokenizer(model_dir, writer)
    names = gguf.get_tensor_name_map(arch, text.num_hidden_layers)
    for name, value in _checkpoint(model_dir).items():
        if not name.startswith('visual.'):
            writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')), value.numpy())
    finish(writer)


def _mmproj_name(name: str, names: gguf.TensorNameMap, deepstack: list[int]) -> str:
    """The GGUF name of a ``visual.*`` tensor, as Qwen3VLVisionModel.modify_tensors gives it."""
    kind = name.rpartition('.')[2]
    if name.startswith('visual.deepstack_merger_list.'):
        index, part = name.split('.')[2:4]
        tensor = {'norm': gguf.MODEL_TENSOR.V_DS_NORM, 'linear_fc1': gguf.MODEL_TENSOR.V_DS_FC1,
                  'linear_fc2': gguf.MODEL_TENSOR.V_DS_FC2}[part]
        return gguf.TENSOR_NAMES[tensor].format(bid=deepstack[int(index)]) + f'.{kind}'
    merger = {'visual.merger.norm': 'v.post_ln', 'visual.merger.linear_fc1': 'mm.0', 'visual.merger.linear_fc2': 'mm.2',
              'visual.patch_embed.proj': 'v.patch_embd'}
    stem = name.rpartition('.')[0]
    return f'{merger[stem]}.{kind}' if stem in merger else names.get_name(name, try_suffixes=('.weight', '.bias'))


def write_qwen3vl_mmproj(model_dir: str, out: Path) -> None:
    """The vision tower as convert_hf_to_gguf.py ``--mmproj`` (Qwen3VLVisionModel) writes it (float32), Qwen3-VL's or
    Qwen3.5's."""
    config = AutoConfig.from_pretrained(model_dir)
    vision = config.vision_config
    deepstack = getattr(vision, 'deepstack_visual_indexes', [])  # Qwen3.5's tower has none
    writer = gguf.GGUFWriter(str(out), 'clip')
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_vision_projection_dim(vision.out_hidden_size)
    writer.add_vision_image_size(int(vision.num_position_embeddings ** 0.5 * vision.patch_size))
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(vision.depth)
    writer.add_vision_head_count(vision.num_heads)
    processor = json.loads(Path(model_dir, 'preprocessor_config.json').read_text())
    writer.add_vision_image_mean(processor['image_mean'])
    writer.add_vision_image_std(processor['image_std'])
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision.spatial_merge_size)
    writer.add_vision_attention_layernorm_eps(config.text_config.rms_norm_eps)
    writer.add_vision_is_deepstack_layers([i in deepstack for i in range(vision.depth)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    for name, value in _checkpoint(model_dir).items():
        if not name.startswith('visual.'):
            continue
        if name == 'visual.patch_embed.proj.weight':
            patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
            writer.add_tensor(f'{patch}.weight', value[:, :, 0].contiguous().numpy())
            writer.add_tensor(f'{patch}.weight.1', value[:, :, 1].contiguous().numpy())
        else:
            writer.add_tensor(_mmproj_name(name, names, deepstack), value.numpy())
    finish(writer)


@pytest.fixture(scope='module', params=['qwen3_vl', 'qwen3_vl_moe'])
def qwen3_vl(request, tmp_path_factory) -> str:
    # llama.cpp's map names the merger's layers as blocks of the tower: a depth of 3 or more; deepstack layers
    # that are not 0..n-1 (the mmproj names their mergers by tower layer); every MoE layer sparse (llama.cpp's
    # qwen3vlmoe has no dense ones); the hub's image processor
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(QWEN3_VISION, 'depth', 3)
        patch.setitem(QWEN3_VISION, 'deepstack_visual_indexes', [0, 2])
        patch.setitem(QWEN3_MOE_TEXT, 'mlp_only_layers', [])
        path = save_tiny_vl_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                             size=QWEN3_PIXELS).save_pretrained(path)
    return path


@pytest.fixture(scope='module')
def gguf_pair(qwen3_vl, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('gguf')
    write_qwen3vl_gguf(qwen3_vl, folder / MODEL)
    write_qwen3vl_mmproj(qwen3_vl, folder / MMPROJ)
    return folder


def test_gguf_pair_serves_image_prompts_like_the_original(qwen3_vl, gguf_pair):
    model = str(gguf_pair / MODEL)
    folder = resolve_gguf(model)
    original, converted = _per_expert(_checkpoint(qwen3_vl)), converted_tensors(folder)
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], value) for name, value in original.items())
    assert AutoConfig.from_pretrained(folder).vision_config.deepstack_visual_indexes == [0, 2]
    prompts, from_gguf = assert_serves_like_the_original(qwen3_vl, model, folder)
    assert torch.equal(first_step_logits(make_engine(model), from_gguf),
                       first_step_logits(make_engine(qwen3_vl), prompts))


def test_mmproj_missing_or_of_another_model(gguf_pair, tmp_path):
    model = tmp_path / MODEL
    arch = gguf.GGUFReader(str(gguf_pair / MODEL)).fields['general.architecture'].contents()
    shutil.copy(gguf_pair / MODEL, model)
    with pytest.raises(ValueError, match=r'exactly one mmproj\*\.gguf .* found none'):
        resolve_gguf(str(model))
    mmproj = tmp_path / MMPROJ
    shutil.copy(gguf_pair / MMPROJ, mmproj)
    reader = gguf.GGUFReader(str(mmproj), 'r+')
    projector = reader.fields['clip.projector_type']
    projector.parts[projector.data[0]][:] = list(b'qwen2vl_merger')  # Qwen2-VL's, of the same length
    flags = reader.fields['clip.vision.is_deepstack_layers']
    flags.parts[flags.data[2]][:] = 0  # deepstack layers 0 only
    del reader
    with pytest.raises(ValueError, match=f"projector 'qwen2vl_merger' does not pair with a {arch} language model "
                                         r'\(expected one of: qwen3vl_merger\)'):
        resolve_gguf(str(model))
    reader = gguf.GGUFReader(str(mmproj), 'r+')
    projector = reader.fields['clip.projector_type']
    projector.parts[projector.data[0]][:] = list(b'qwen3vl_merger')
    del reader
    with pytest.raises(ValueError, match='the mmproj feeds 1 deepstack layers, the language model takes 2'):
        resolve_gguf(str(model))
    writer = gguf.GGUFWriter(str(mmproj), 'clip')
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    writer.add_vision_embedding_length(32)
    finish(writer)
    with pytest.raises(ValueError, match='missing GGUF metadata: clip.vision.feed_forward_length, '
                                         'clip.vision.block_count, .*clip.vision.spatial_merge_size$'):
        resolve_gguf(str(model))


def test_q8_0_pair_keeps_its_blocks(qwen3_vl, tmp_path):
    """A Q8_0 language model (gguf-py's quantization of each layer's matrices whose inputs are whole blocks of 32;
    the MoE's 48-input down stacks stay F32): the attention and MLP projections and the experts' gate and up stay
    as their blocks, and the fp32 greedy tokens on text and image prompts equal those of the pair dequantized."""
    add_tensor = gguf.GGUFWriter.add_tensor

    def q8_0(writer, name, tensor, *args, **kwargs):
        if name.startswith('blk.') and tensor.ndim >= 2 and tensor.shape[-1] % 32 == 0 and 'gate_inp' not in name:
            return add_tensor(writer, name, quantize(tensor, Q.Q8_0), raw_dtype=Q.Q8_0)
        return add_tensor(writer, name, tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, 'add_tensor', q8_0)
        write_qwen3vl_gguf(qwen3_vl, tmp_path / MODEL)
    write_qwen3vl_mmproj(qwen3_vl, tmp_path / MMPROJ)
    dequantized = tmp_path / 'dequantized'
    convert_gguf(str(tmp_path / MODEL), str(dequantized), raw_types=())
    prompts = [make_processor(str(dequantized)).process(prompt) for prompt in PROMPTS]
    engine = make_engine(str(tmp_path / MODEL))
    try:
        assert {kind for layer, kind in linear_formats(engine).items() if '.self_attn.' in layer} == {'Q8_0'}
        experts = [m for m in engine.runner.model.modules() if isinstance(m, FusedExperts)]
        assert all(hasattr(m, 'gate_up_qweight') and not hasattr(m, 'down_qweight') for m in experts)
        assert bool(experts) == ('moe' in qwen3_vl)
        outs = run(engine, prompts)
    finally:
        engine.close()
    assert run(make_engine(str(dequantized)), prompts) == outs
