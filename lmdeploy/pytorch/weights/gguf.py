"""Convert a GGUF checkpoint (llama.cpp format) into a Hugging Face-style model folder."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm.auto import tqdm

from lmdeploy.messages import ConfigError
from lmdeploy.model_source import ModelNotFoundError

from .file_checks import check_gguf, open_gguf
from .gguf_archs import (ARCHITECTURES, CONFIG_BUILDERS, GLOBAL_NAMES, LAYER_NAMES, METADATA_TENSORS,
                         RAW_SERVED_ARCHS, unpermute_rotary)
from .gguf_gemma4 import UNSUFFIXED_NAMES as GEMMA4_UNSUFFIXED_NAMES
from .gguf_hybrid import PERMUTED_ARCHS as MAMBA2_PERMUTED_ARCHS
from .gguf_keys import metadata
from .gguf_hybrid import UNSUFFIXED_NAMES as MAMBA2_UNSUFFIXED_NAMES
from .gguf_kimi_linear import UNSUFFIXED_NAMES as KIMI_LINEAR_UNSUFFIXED_NAMES
from .gguf_mamba import UNSUFFIXED_NAMES as MAMBA1_UNSUFFIXED_NAMES
from .gguf_qwen3_next import ARCHITECTURES as HYBRID_ARCHS
from .gguf_qwen3_next import FILE_LAYOUT as HYBRID_FILE_LAYOUT
from .gguf_qwen3_next import UNSUFFIXED_NAMES
from .gguf_rope import ROPE_FREQS, ROTARY_TENSORS, llama3_rope, phi3_rope
from .gguf_tokenizer import save_tokenizer
from .gguf_tensors import finish_state_dict, mxfp4_from_ggml, shared_tensor
from .gguf_types import EMBEDDING_RAW_TYPES, LM_HEAD_RAW_TYPES, MXFP4, RAW_TYPES, engine_layer, served_types
from .gguf_vl import VisionFamily, pair_mmproj, vision_family

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS: dict[str, str] = {
    'llama': 'LlamaForCausalLM',
    'qwen2': 'Qwen2ForCausalLM',
    'qwen3': 'Qwen3ForCausalLM',
    'phi3': 'Phi3ForCausalLM',
    'smollm3': 'SmolLM3ForCausalLM',
    **ARCHITECTURES,
    'qwen2vl': 'Qwen2VLForConditionalGeneration',  # with its mmproj file (gguf_vl/)
    'qwen3vl': 'Qwen3VLForConditionalGeneration',  # with its mmproj file
    'qwen3vlmoe': 'Qwen3VLMoeForConditionalGeneration',  # with its mmproj file
}

_GLOBAL_NAMES = {'token_embd': 'model.embed_tokens', 'output_norm': 'model.norm', 'output': 'lm_head',
                 'token_embd_norm': 'model.embedding_norm'}  # LFM2's final norm, by its checkpoints' name
_LAYER_NAMES = {
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'attn_q_norm': 'self_attn.q_norm',
    'attn_k_norm': 'self_attn.k_norm',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
    'attn_norm': 'input_layernorm',
    'ffn_norm': 'post_attention_layernorm',
    # a MoE layer's router and its experts, stacked (split per expert by ``finish_state_dict``)
    'ffn_gate_inp': 'mlp.gate',
    'ffn_gate_exps': 'mlp.experts.gate_proj',
    'ffn_up_exps': 'mlp.experts.up_proj',
    'ffn_down_exps': 'mlp.experts.down_proj',
}
# names that differ by architecture: Phi-3 keeps q/k/v and gate/up fused, as its Hugging Face checkpoints do
_ARCH_LAYER_NAMES = {
    'phi3': {'attn_qkv': 'self_attn.qkv_proj', 'ffn_up': 'mlp.gate_up_proj'},
    **LAYER_NAMES,
}
# llama.cpp's converter reorders the q/k rows of Llama-derived models for its rotary (undone at load)
_PERMUTED_ARCHS = ('llama', 'smollm3', 'mistral3', 'granite', 'arcee', 'granitemoe', *MAMBA2_PERMUTED_ARCHS)
# llama.cpp runs SmolLM3 without rotary in every fourth layer; its GGUF files carry no key for it
SMOLLM3_NO_ROPE_INTERVAL = 4
_LAYER_RE = re.compile(r'blk\.(\d+)\.([\w.]+)')  # LFM2's ``shortconv.in_proj`` has a dot
# tensors llama.cpp names without a ``.weight``/``.bias`` kind (``ssm_a``; Mamba-2's ``ssm_d``)
_UNSUFFIXED_NAMES = {**dict.fromkeys(HYBRID_ARCHS, UNSUFFIXED_NAMES), **MAMBA2_UNSUFFIXED_NAMES,
                     **MAMBA1_UNSUFFIXED_NAMES, **KIMI_LINEAR_UNSUFFIXED_NAMES, 'gemma4': GEMMA4_UNSUFFIXED_NAMES}
_LAYER_INDEX = re.compile(r'blk\.(\d+)\.')
_EXPERTS = re.compile(r'blk\.\d+\.ffn_(gate|up|down)_exps\.weight')
# llama.cpp pre-tokenizers that transformers' GGUF reader does not know, by the one of its splits they use
# (GLM-4's is Llama 3's); without one it would split text as GPT-2 does
# the tables a ``quantization_config`` may keep as their blocks, by the key that names their type there
_TABLES = {'lm_head.weight': 'lm_head', 'model.embed_tokens.weight': 'embed_tokens'}
_CACHE_FORMAT = 19  # bump when the converted output changes, so stale cache entries are not reused


def cache_dir() -> Path:
    """The lmdeploy cache root: ``$LMDEPLOY_CACHE_DIR`` or ``~/.cache/lmdeploy``."""
    return Path(os.environ.get('LMDEPLOY_CACHE_DIR') or Path.home() / '.cache' / 'lmdeploy')


def hf_tensor_name(gguf_name: str, arch: str = 'llama') -> str | None:
    """The transformers parameter name of a llama.cpp tensor of ``arch``, or None if it has none."""
    base, _, kind = gguf_name.rpartition('.')
    unsuffixed = _LAYER_RE.fullmatch(gguf_name)
    if unsuffixed and unsuffixed[2] in _UNSUFFIXED_NAMES.get(arch, {}):
        return f'model.layers.{unsuffixed[1]}.{_UNSUFFIXED_NAMES[arch][unsuffixed[2]]}'
    if kind not in ('weight', 'bias'):
        return None
    global_names = _GLOBAL_NAMES | GLOBAL_NAMES.get(arch, {})
    if base in global_names:
        return f'{global_names[base]}.{kind}'
    match = _LAYER_RE.fullmatch(base)
    names = _LAYER_NAMES | _ARCH_LAYER_NAMES.get(arch, {})
    if match and f'{match[2]}.{kind}' in names:
        return f'model.layers.{match[1]}.{names[match[2] + "." + kind]}'
    if match and match[2] in names:
        return f'model.layers.{match[1]}.{names[match[2]]}.{kind}'
    return None


def _arch_meta(reader: GGUFReader, arch: str) -> Any:
    """A reader of the file's metadata by gguf-py ``Keys`` template (``{arch}`` filled in) and default."""
    return lambda template, default=None: metadata(reader, template.format(arch=arch), default)


def gguf_config(reader: GGUFReader, source: str, raw_types: Iterable[str] = RAW_TYPES) -> dict[str, Any]:
    """A transformers config dict built from the GGUF metadata of ``source``; the decoder's linear layers
    whose projections are all of one type of ``raw_types`` are listed in its ``quantization_config``; a gpt-oss
    file whose experts are all MXFP4 (with MXFP4 in ``raw_types``) is an MXFP4 checkpoint (``quant_method:
    mxfp4``)."""
    arch = metadata(reader, 'general.architecture')
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f'{source}: unsupported GGUF architecture {arch!r}; lmdeploy serves: '
                          f'{", ".join(SUPPORTED_ARCHS)}')
    key = lambda name, default=None: metadata(reader, f'{arch}.{name}', default)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    # Qwen3.5-MoE has no dense MLP (its files no feed_forward_length)
    required = ('embedding_length', 'block_count', 'attention.head_count') + (
        () if arch == 'qwen35moe' else ('feed_forward_length',))
    missing = [f'{arch}.{name}' for name in required if key(name) is None]
    if 'token_embd.weight' not in tensors:
        missing.append('tensor token_embd.weight')
    if missing:
        raise ConfigError(f'{source}: missing GGUF metadata: {", ".join(missing)}')
    hidden, heads = key('embedding_length'), key('attention.head_count')
    linear = tensors.get('blk.0.attn_q.weight', tensors.get('blk.0.attn_qkv.weight'))  # the linear layers' type
    head_dim = key('attention.key_length') or (key('rope.dimension_count') if arch in _PERMUTED_ARCHS else None)
    config = {
        'model_type': arch,
        'architectures': [SUPPORTED_ARCHS[arch]],
        'hidden_size': hidden,
        'intermediate_size': key('feed_forward_length'),
        'num_hidden_layers': key('block_count'),
        'num_attention_heads': heads,
        'num_key_value_heads': key('attention.head_count_kv', heads),
        'head_dim': head_dim or (hidden // heads if heads else None),  # Mamba's files: no heads
        'max_position_embeddings': key('context_length', 2048),
        'rms_norm_eps': key('attention.layer_norm_rms_epsilon', 1e-6),
        'rope_theta': key('rope.freq_base', 10000.0),
        'vocab_size': int(tensors['token_embd.weight'].shape[-1]),  # ggml order: (hidden, vocab)
        # Qwen2 has q/k/v biases by its type and none on o_proj, which attention_bias would add
        'attention_bias': 'blk.0.attn_q.bias' in tensors and arch not in ('qwen2', 'qwen2moe', 'qwen2vl'),
        'tie_word_embeddings': 'output.weight' not in tensors,
        'bos_token_id': metadata(reader, 'tokenizer.ggml.bos_token_id'),
        'eos_token_id': _end_ids(reader),
        'pad_token_id': metadata(reader, 'tokenizer.ggml.padding_token_id'),
        'dtype': 'float32',
        'gguf_weight_type': linear.tensor_type.name if linear is not None else None,
    }
    layer_types = served_types(((hf_tensor_name(t.name, arch), t.tensor_type.name) for t in reader.tensors),
                               set(raw_types) - {MXFP4})
    if layer_types:
        config['quantization_config'] = {'quant_method': 'gguf', 'ggml_types': layer_types}
    if arch == 'phi3':
        config.update(phi3_rope(lambda name: metadata(reader, f'phi3.{name}'), tensors, config['head_dim'], source))
    elif arch == 'smollm3':
        config['no_rope_layer_interval'] = SMOLLM3_NO_ROPE_INTERVAL
    elif arch in CONFIG_BUILDERS:
        try:
            config.update(CONFIG_BUILDERS[arch](_arch_meta(reader, arch), tensors, config))
        except ValueError as err:
            raise ConfigError(f'{source}: {err}') from err
        if arch in HYBRID_ARCHS and set(raw_types):  # for the engine: the linear attention as the file holds it
            config.update(HYBRID_FILE_LAYOUT[arch])
        if arch not in RAW_SERVED_ARCHS:  # linear layers beyond the projections (MLA's, routers) have no raw form
            experts = {name: t for name, t in layer_types.items() if '.mlp.experts.' in name}  # DeepSeek's experts
            config.pop('quantization_config', None)
            if experts:
                config['quantization_config'] = {'quant_method': 'gguf', 'ggml_types': experts}
    if ROPE_FREQS in tensors and arch != 'gemma4':  # Gemma 4's: its full layers' proportional rope, read above
        config['rope_parameters'] = _rope_from_freqs(tensors[ROPE_FREQS], config, source)
    expert_types = {t.tensor_type.name for name, t in tensors.items() if _EXPERTS.fullmatch(name)}
    if arch == 'gpt-oss' and MXFP4 in raw_types and expert_types == {MXFP4}:
        config['quantization_config'] = {'quant_method': 'mxfp4'}
    output = tensors.get('output.weight')
    head_types = LM_HEAD_RAW_TYPES & set(raw_types)
    gguf_blocks = config.get('quantization_config', {}).get('quant_method') == 'gguf'
    if gguf_blocks and output is not None and output.tensor_type.name in head_types:
        config['quantization_config']['lm_head'] = output.tensor_type.name
    embedding = tensors['token_embd.weight'].tensor_type.name
    if gguf_blocks and embedding in EMBEDDING_RAW_TYPES & set(raw_types):
        config['quantization_config']['embed_tokens'] = embedding
    check_gguf(reader, arch, config, source)
    return config


def _end_ids(reader: GGUFReader) -> int | list[int] | None:
    """The tokens that end a reply: the end of text and, where the file names another, the end of a turn
    (GLM-4's ``<|user|>``, Llama 3's ``<|eot_id|>``), as llama.cpp stops at either."""
    ids = [metadata(reader, f'tokenizer.ggml.{name}_token_id') for name in ('eos', 'eot')]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return ids if len(ids) > 1 else (ids or [None])[0]


def _rope_from_freqs(freqs: Any, config: dict[str, Any], source: str) -> dict[str, Any]:
    """Llama 3.1+'s rotary scaling, which llama.cpp keeps only as the per-frequency divisors ``rope_freqs``."""
    if 'rope_parameters' in config:
        raise ConfigError(f'{source}: {ROPE_FREQS} beside the {config["model_type"]} rotary is not supported')
    try:
        return llama3_rope(np.asarray(freqs.data), config['rope_theta'], config['head_dim'], source)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def layer_groups(reader: GGUFReader, num_layers: int) -> list[list[Any]]:
    """The file's tensors not in a decoder layer (embeddings, output), then those of each layer in layer order: each
    group is converted and written on its own, so that conversion holds one layer at a time, and loading dequantizes
    the output layer before the layers fill the memory. Blocks past the decoder's ``num_layers`` (GLM-4.5's
    next-token-prediction layers) are left out."""
    groups: dict[int, list[Any]] = defaultdict(list)
    for tensor in reader.tensors:
        match = _LAYER_INDEX.match(tensor.name)
        groups[int(match[1]) if match else -1].append(tensor)
    kept = [index for index in groups if index < num_layers]
    return [groups[index] for index in sorted(kept)]


def gguf_state_dict(reader: GGUFReader, tensors: Iterable[Any], config: dict[str, Any],
                    source: str) -> dict[str, torch.Tensor]:
    """``tensors`` (one of :func:`layer_groups`) under their transformers names: dequantized to float32,
    except the projections of the layers in ``config['quantization_config']``, kept as their blocks
    (``qweight uint8 [rows, blocks, bytes]``; a MoE layer's experts ``[experts, rows, blocks, bytes]``, one
    tensor per expert once finished), the output layer and the token embedding where it names their types
    (``lm_head``: ``lm_head.qweight``; ``embed_tokens``: ``model.embed_tokens.qweight``), and an MXFP4
    checkpoint's experts as its ``_blocks`` and ``_scales``."""
    arch = metadata(reader, 'general.architecture')
    heads = {'attn_q': config['num_attention_heads'], 'attn_k': config['num_key_value_heads']}
    quantization = config.get('quantization_config', {})
    layer_types = quantization.get('ggml_types', {})
    mxfp4 = quantization.get('quant_method') == 'mxfp4'
    state_dict = {}
    for tensor in tensors:
        if tensor.name in ROTARY_TENSORS:
            continue
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            logger.warning('Skipping GGUF tensor %s: no transformers counterpart', tensor.name)
            continue
        if mxfp4 and tensor.tensor_type == GGMLQuantizationType.MXFP4:
            state_dict[f'{name}_blocks'], state_dict[f'{name}_scales'] = mxfp4_from_ggml(tensor.data)
            continue
        try:
            if engine_layer(name) in layer_types or _TABLES.get(name) in quantization:
                block_bytes = GGML_QUANT_SIZES[tensor.tensor_type][1]
                data = np.asarray(tensor.data, dtype=np.uint8)
                weight = data.reshape(*data.shape[:-1], -1, block_bytes)  # the file's bytes, written as they are
                name = name.removesuffix('.weight') + '.qweight'
            else:
                weight = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except Exception as err:
            raise ConfigError(f'{source}: cannot dequantize tensor {tensor.name} '
                             f'({tensor.tensor_type.name}): {err}') from err
        module = tensor.name.split('.')[-2]
        if arch in _PERMUTED_ARCHS and module in heads:
            weight = unpermute_rotary(weight, heads[module])
        state_dict[name] = shared_tensor(np.ascontiguousarray(weight))
        if arch in METADATA_TENSORS and module == 'attn_norm':  # once a layer
            state_dict |= METADATA_TENSORS[arch](_arch_meta(reader, arch), int(_LAYER_INDEX.match(tensor.name)[1]))
    finish_state_dict(arch, state_dict, config)
    return state_dict


def _vl_config(family: VisionFamily, text: dict[str, Any], reader: GGUFReader, mmproj: GGUFReader,
               source: str) -> dict[str, Any]:
    """The vision-language model's config: ``family``'s from the language model's ``text`` config, with the
    language model's ``quantization_config`` at its top level (where the loader and transformers read it: the
    tower stays dense)."""
    quantization = text.get('quantization_config')
    text = {key: value for key, value in text.items() if key != 'quantization_config'}
    config = family.config(text, reader, mmproj, list(metadata(reader, 'tokenizer.ggml.tokens', [])), source)
    return config if quantization is None else config | {'quantization_config': quantization}


def convert_gguf(gguf_path: str, out_dir: str, raw_types: Iterable[str] = RAW_TYPES,
                 mmproj_path: str | None = None) -> None:
    """Write the weights (float32, but the projections of layers served as their blocks: of ``raw_types``, see
    :func:`served_types`), one safetensors file per decoder layer and one for the rest with their index,
    ``config.json`` and tokenizer files for a GGUF file; with no ``raw_types``, every tensor in float32, a
    folder that transformers loads. One layer is in memory at a time, besides the file's mapping. A
    vision-language model's language model takes its ``mmproj_path`` (by default the one
    :func:`~.gguf_vl.pair_mmproj` finds beside it): its layers as a text model's, the tower and projector in
    float32 in one more shard, with its image processor's config.

    The folder is built next to ``out_dir`` and renamed into place, so it is either complete or absent.
    """
    from transformers import AutoConfig
    src, out = Path(gguf_path).absolute(), Path(out_dir).absolute()
    if out.exists():
        raise FileExistsError(f'output folder {out} already exists')
    reader = open_gguf(src)
    arch = metadata(reader, 'general.architecture')
    if mmproj_path is None:
        mmproj_path = pair_mmproj(src, arch)
    vl = mmproj_path is not None
    config = gguf_config(reader, str(src), raw_types)
    if vl:  # the vision-language models read the embedding's table for its device and dtype
        config.get('quantization_config', {}).pop('embed_tokens', None)
    mmproj = open_gguf(mmproj_path) if vl else None
    family = vision_family(mmproj, arch, str(mmproj_path)) if vl else None
    model_config = _vl_config(family, config, reader, mmproj, str(mmproj_path)) if vl else config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f'.{out.name}.tmp-', dir=out.parent))
    try:
        tmp.chmod(0o755)
        groups = layer_groups(reader, config['num_hidden_layers']) + ([mmproj] if vl else [])
        weight_map = {}
        for index, tensors in enumerate(tqdm(groups, desc=f'Converting {src.name}', unit='layer')):
            state_dict = (family.state_dict(tensors) if tensors is mmproj else
                          gguf_state_dict(reader, tensors, config, str(src)))
            shard = f'model-{index + 1:05d}-of-{len(groups):05d}.safetensors'
            save_file(state_dict, str(tmp / shard), metadata={'format': 'pt'})
            (tmp / shard).chmod(0o644)
            weight_map |= dict.fromkeys(state_dict, shard)
            del state_dict
        (tmp / 'model.safetensors.index.json').write_text(json.dumps({'metadata': {}, 'weight_map': weight_map}))
        AutoConfig.for_model(**model_config).save_pretrained(str(tmp))
        if vl:
            (tmp / 'preprocessor_config.json').write_text(json.dumps(family.image_processor(mmproj)))
        save_tokenizer(src, tmp, reader)
        try:
            tmp.rename(out)
        except OSError as err:
            if out.exists():
                raise FileExistsError(f'output folder {out} was created concurrently') from err
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_gguf(gguf_path: str, raw_types: Iterable[str] = RAW_TYPES) -> str:
    """The cached HF folder for a GGUF file (see :func:`convert_gguf`), converting it on first use; a
    vision-language model's language model takes the ``mmproj*.gguf`` file beside it
    (:func:`~.gguf_vl.pair_mmproj`).

    Keyed by the files' absolute paths, sizes and mtimes (and the converter format and ``raw_types``), so an
    edited file is converted again. Files that cannot be served (truncated, corrupt, metadata that disagrees with
    the tensors, an architecture not served) raise :class:`~lmdeploy.messages.ConfigError` and leave no folder.
    """
    src = Path(gguf_path).absolute()
    if not src.is_file():
        raise ModelNotFoundError(f'GGUF file {gguf_path} does not exist')
    try:
        return _converted(src, raw_types)
    except ConfigError:
        raise
    except ValueError as err:  # the converters' checks of what the files hold
        raise ConfigError(str(err)) from err


def _converted(src: Path, raw_types: Iterable[str]) -> str:
    # only a folder holding an mmproj file costs a look at the architecture
    mmproj = pair_mmproj(src, metadata(open_gguf(src), 'general.architecture')) if any(
        src.parent.glob('mmproj*.gguf')) else None
    files = ''.join(f'\0{p}\0{p.stat().st_size}\0{p.stat().st_mtime_ns}' for p in (src, mmproj) if p is not None)
    raw = ','.join(sorted(raw_types))
    key = hashlib.sha256(f'{_CACHE_FORMAT}{files}\0{raw}'.encode()).hexdigest()[:16]
    out = cache_dir() / 'gguf' / f'{src.stem}-{key}'
    if not (out / 'config.json').is_file():
        try:
            convert_gguf(str(src), str(out), raw_types, None if mmproj is None else str(mmproj))
        except FileExistsError:
            if not (out / 'config.json').is_file():
                raise
    return str(out)
