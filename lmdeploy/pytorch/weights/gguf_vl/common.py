"""What every vision-language GGUF family shares: reading an mmproj file's metadata and tensors, finding the
mmproj beside a language model's GGUF, and the :class:`VisionFamily` each projector type provides."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

TOWER_BLOCK = re.compile(r'v\.blk\.(\d+)\.(\w+)\.(weight|bias)')  # a tower layer's tensor: layer, name, kind
SIGLIP_LAYER_NAMES = {'attn_q': 'self_attn.q_proj', 'attn_k': 'self_attn.k_proj', 'attn_v': 'self_attn.v_proj',
                      'attn_out': 'self_attn.out_proj', 'ln1': 'layer_norm1', 'ln2': 'layer_norm2',
                      'ffn_up': 'mlp.fc1', 'ffn_down': 'mlp.fc2'}
SIGLIP_NAMES = {'v.patch_embd.weight': 'embeddings.patch_embedding.weight',
                'v.patch_embd.bias': 'embeddings.patch_embedding.bias',
                'v.position_embd.weight': 'embeddings.position_embedding.weight',
                'v.post_ln.weight': 'post_layernorm.weight', 'v.post_ln.bias': 'post_layernorm.bias'}


def siglip_tower_name(name: str, tower: str) -> str | None:
    """The checkpoint name (under ``tower``) of an mmproj's SigLIP tower tensor ``name``: its layers
    (``encoder.layers.N``), embeddings and final norm; None for the others."""
    block = TOWER_BLOCK.fullmatch(name)
    if block and block[2] in SIGLIP_LAYER_NAMES:
        return f'{tower}encoder.layers.{block[1]}.{SIGLIP_LAYER_NAMES[block[2]]}.{block[3]}'
    return tower + SIGLIP_NAMES[name] if name in SIGLIP_NAMES else None


@dataclass(frozen=True)
class VisionFamily:
    """How llama.cpp's two files of one vision-language family become a transformers folder.

    ``config(text, reader, mmproj, tokens, source)`` gives the model's config dict from the language model's
    config (``text``, built from its GGUF), both readers and the vocabulary; ``state_dict(mmproj)`` the tower's
    and projector's tensors under the checkpoint's names; ``image_processor(mmproj)`` the
    ``preprocessor_config.json``."""
    text_archs: tuple[str, ...]  # the language-model GGUF architectures it pairs with
    config: Callable[[dict[str, Any], GGUFReader, GGUFReader, list[str], str], dict[str, Any]]
    state_dict: Callable[[GGUFReader], dict[str, torch.Tensor]]
    image_processor: Callable[[GGUFReader], dict[str, Any]]


def meta(reader: GGUFReader, key: str) -> Any:
    """The value of a GGUF metadata ``key``, or None."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def require_vision_keys(mmproj: GGUFReader, names: tuple[str, ...], source: str) -> None:
    """Raise naming each ``clip.vision.<name>`` key the mmproj lacks."""
    missing = [f'clip.vision.{name}' for name in names if meta(mmproj, f'clip.vision.{name}') is None]
    if missing:
        raise ValueError(f'{source}: missing GGUF metadata: {", ".join(missing)}')


def float32_tensors(mmproj: GGUFReader) -> dict[str, torch.Tensor]:
    """Every tensor of ``mmproj`` by its GGUF name, dequantized to float32 (in torch's dimension order)."""
    return {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            for t in mmproj.tensors}


def mmproj_files(gguf_path: Path) -> list[Path]:
    """The ``mmproj*.gguf`` files beside ``gguf_path`` (where llama.cpp users keep them)."""
    return sorted(p for p in gguf_path.parent.glob('mmproj*.gguf') if p != gguf_path)


def find_mmproj(gguf_path: Path) -> Path:
    """The one ``mmproj*.gguf`` file beside ``gguf_path``."""
    found = mmproj_files(gguf_path)
    if len(found) != 1:
        what = 'none' if not found else ', '.join(p.name for p in found)
        raise ValueError(f'{gguf_path} is the language model of a vision-language model: it needs exactly one '
                         f'mmproj*.gguf file (llama.cpp\'s vision tower) in the same folder; found {what}')
    return found[0]
