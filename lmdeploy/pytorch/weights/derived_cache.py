"""A disk cache of tensors derived from a weight at every start (a 4-bit grid fitted to a bf16 weight and packed
for its kernel, a GGUF token table retiled for its GEMV), so that a model's later starts read them instead of
computing them again.

An entry is keyed by the sha256 of the weight's bytes, its dtype and shape, what was derived (a name and its
arguments) and the source text of the modules that derive it: another weight, or an edit of the code that
derives it, never finds the entry. Entries are safetensors files under ``cache_dir()/derived``, written to a
temporary name and renamed into place; one that cannot be read is derived again and rewritten. Weights under
:data:`MIN_CACHED_NUMEL` elements are derived every time (in about a millisecond: a file would cost more).
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

MIN_CACHED_NUMEL = 1 << 18


def weight_digest(weight: torch.Tensor) -> str:
    """sha256 of a CPU tensor's dtype, shape and bytes."""
    digest = hashlib.sha256(f'{weight.dtype}{tuple(weight.shape)}'.encode())
    digest.update(weight.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _source_digest(source_files: str | Sequence[str]) -> str:
    files = [source_files] if isinstance(source_files, str) else source_files
    return '\0'.join(hashlib.sha256(Path(source_file).read_bytes()).hexdigest() for source_file in files)


def entry_path(kind: str, weight: torch.Tensor, source_files: str | Sequence[str]) -> Path:
    """Where the tensors ``kind`` derives from ``weight`` (by the code in ``source_files``) are kept."""
    from lmdeploy.pytorch.weights.gguf import cache_dir
    key = hashlib.sha256(f'{kind}\0{_source_digest(source_files)}\0{weight_digest(weight)}'.encode()).hexdigest()
    return cache_dir() / 'derived' / f'{key[:32]}.safetensors'


def cached_derivation(kind: str, weight: torch.Tensor, source_files: str | Sequence[str],
                      derive: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """``derive()``'s tensors, read from the cache when ``weight`` was derived the same way before (``kind`` names
    the derivation and its arguments, ``source_files`` the module, or modules, that hold its code), else derived
    and stored."""
    if weight.numel() < MIN_CACHED_NUMEL or weight.device.type != 'cpu':
        return derive()
    path = entry_path(kind, weight, source_files)
    if path.is_file():
        try:
            stored = load_file(str(path))
            return tuple(stored[str(i)] for i in range(len(stored)))
        except (SafetensorError, OSError, KeyError) as err:
            logger.warning('derived-weight cache entry %s is unreadable (%s); deriving it again', path, err)
    tensors = derive()
    _store(path, tensors)
    return tensors


def _store(path: Path, tensors: tuple[torch.Tensor, ...]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(prefix=f'.{path.stem}.', dir=path.parent)
        os.close(fd)
        try:
            save_file({str(i): t.contiguous() for i, t in enumerate(tensors)}, staged)
            os.chmod(staged, 0o644)
            os.replace(staged, path)
        finally:
            if os.path.exists(staged):
                os.unlink(staged)
    except OSError as err:  # a read-only or full cache costs the next start the derivation, nothing else
        logger.warning('cannot write derived-weight cache entry %s: %s', path, err)
