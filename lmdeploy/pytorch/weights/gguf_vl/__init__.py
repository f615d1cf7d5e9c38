"""Vision-language models from llama.cpp's two files: the language model's GGUF and the ``mmproj`` GGUF
(architecture ``clip``) that convert_hf_to_gguf.py ``--mmproj`` (LLaVA: the legacy convert_image_encoder_to_gguf.py)
writes for the vision tower and projector.
Each projector type (``clip.projector_type``) has its :class:`VisionFamily`, one module per family."""
from __future__ import annotations

import logging
from pathlib import Path

from gguf import GGUFReader

from ..file_checks import open_gguf
from .common import VisionFamily, find_mmproj, meta, mmproj_files
from .gemma3 import GEMMA3
from .glm4v import GLM4V
from .idefics3 import IDEFICS3
from .internvl import INTERNVL
from .lfm2 import LFM2_VL
from .llama4 import LLAMA4
from .llava import LLAVA
from .pixtral import PIXTRAL
from .qwen2 import QWEN2_VL
from .qwen3 import QWEN3_VL

FAMILIES: dict[str, VisionFamily] = {'qwen2vl_merger': QWEN2_VL, 'qwen2.5vl_merger': QWEN2_VL,
                                     'qwen3vl_merger': QWEN3_VL, 'internvl': INTERNVL, 'mlp': LLAVA,
                                     'gemma3': GEMMA3, 'pixtral': PIXTRAL, 'llama4': LLAMA4,
                                     'idefics3': IDEFICS3, 'lfm2': LFM2_VL,
                                     'glm4v': GLM4V}
# language-model architectures that only ever come with an mmproj file
VL_ONLY_ARCHS = frozenset({'qwen2vl', 'qwen3vl', 'qwen3vlmoe'})

logger = logging.getLogger(__name__)


def pair_mmproj(gguf_path: Path, arch: str) -> Path | None:
    """The mmproj file a language model's GGUF (of architecture ``arch``) is served with, or None for a text
    model: a :data:`VL_ONLY_ARCHS` file needs exactly one ``mmproj*.gguf`` beside it; another takes the single
    one beside it whose projector pairs with ``arch`` (so a plain ``qwen2`` or ``llama`` file beside another
    model's mmproj stays a text model, with a warning)."""
    if arch in VL_ONLY_ARCHS:
        return find_mmproj(gguf_path)
    found = mmproj_files(gguf_path)
    projector = meta(open_gguf(found[0]), 'clip.projector_type') if len(found) == 1 else None
    family = FAMILIES.get(projector)
    if family is not None and arch in family.text_archs:
        return found[0]
    if found:
        why = (f'{len(found)} of them' if len(found) > 1 else
               f'its projector {projector!r} does not pair with a {arch} language model')
        logger.warning('%s is served as a text model: it pairs with exactly one mmproj*.gguf file in its folder, '
                       'and %s', gguf_path, why)
    return None


def vision_family(mmproj: GGUFReader, arch: str, source: str) -> VisionFamily:
    """The family of an mmproj file paired with a language model of architecture ``arch``."""
    projector = meta(mmproj, 'clip.projector_type')
    family = FAMILIES.get(projector)
    if family is None or arch not in family.text_archs:
        pairs = ', '.join(p for p, f in FAMILIES.items() if arch in f.text_archs) or 'none'
        raise ValueError(f'{source}: mmproj projector {projector!r} does not pair with a {arch} language model '
                         f'(expected one of: {pairs})')
    return family


__all__ = ['FAMILIES', 'VL_ONLY_ARCHS', 'VisionFamily', 'pair_mmproj', 'vision_family']
