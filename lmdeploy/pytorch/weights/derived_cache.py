"""A disk cache of tensors derived from a weight at every start (a 4-bit grid fitted to a bf16 weight and packed
for its kernel, a GGUF token table retiled for its GEMV, a GGUF Q4_K or Q6_K layer packed for its GEMV), so that a
model's later starts read them instead of computing them again.

An entry is keyed by the sha256 of the weight's bytes, its dtype and shape, what was derived (a name and its
arguments) and the source text of the modules that derive it: another weight, or an edit of the code that
derives it, never finds the entry. Entries are safetensors files under ``cache_dir()/derived``, written to a
temporary name and renamed into place; one that cannot be read is derived again and rewritten. Weights under
:data:`MIN_CACHED_NUMEL` elements are derived every time (in about a millisecond: a file would cost more).

The folder holds at most ``$LMDEPLOY_DERIVED_CACHE_BYTES`` (:data:`DEFAULT_CAP_BYTES`; 0 turns the cache off):
after each write the least recently used entries go first (a read refreshes an entry's time), never one that this
process read or wrote (the model being loaded); a write that would take this process's own entries over the cap is
skipped. Entries that another process removes or writes meanwhile are taken as they come.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

MIN_CACHED_NUMEL = 1 << 18
DEFAULT_CAP_BYTES = 4 << 30
# the entries this process read or wrote, and their bytes: never evicted by it
_used_here: dict[Path, int] = {}
# id(weight) -> (the weight, weakly; its version counter; its digest): a weight that several derivations key on
# (a bf16 layer's int4 grid and its packed panels) is hashed once while it lives unchanged
_digests: dict[int, tuple[weakref.ref, int, str]] = {}


def cap_bytes() -> int:
    """The most bytes the cache holds: ``$LMDEPLOY_DERIVED_CACHE_BYTES``, else :data:`DEFAULT_CAP_BYTES`."""
    value = os.environ.get('LMDEPLOY_DERIVED_CACHE_BYTES', '').strip()
    if not value:
        return DEFAULT_CAP_BYTES
    if not value.isdigit():
        raise ValueError(f'LMDEPLOY_DERIVED_CACHE_BYTES is a number of bytes (0: no cache), not {value!r}')
    return int(value)


def weight_digest(weight: torch.Tensor) -> str:
    """sha256 of a CPU tensor's dtype, shape and bytes; computed once for a tensor while it lives and is not
    written in place (its version counter)."""
    known = _digests.get(id(weight))
    if known is not None and known[0]() is weight and known[1] == weight._version:
        return known[2]
    digest = hashlib.sha256(f'{weight.dtype}{tuple(weight.shape)}'.encode())
    digest.update(weight.detach().contiguous().view(-1).view(torch.uint8).numpy())
    key = id(weight)
    _digests[key] = (weakref.ref(weight, lambda _: _digests.pop(key, None)), weight._version, digest.hexdigest())
    return _digests[key][2]


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
    cap = cap_bytes()
    if weight.numel() < MIN_CACHED_NUMEL or weight.device.type != 'cpu' or cap == 0:
        return derive()
    path = entry_path(kind, weight, source_files)
    if path.is_file():
        try:
            stored = load_file(str(path))
            tensors = tuple(stored[str(i)] for i in range(len(stored)))
        except FileNotFoundError:  # removed by another process meanwhile
            tensors = None
        except (SafetensorError, OSError, KeyError) as err:
            logger.warning('derived-weight cache entry %s is unreadable (%s); deriving it again', path, err)
            tensors = None
        if tensors is not None:
            _used_here[path] = _entry_bytes(tensors)
            try:
                os.utime(path)  # its time of last use
            except OSError:  # removed meanwhile, or a read-only cache
                pass
            return tensors
    tensors = derive()
    size = _entry_bytes(tensors)
    held_here = sum(n for used, n in _used_here.items() if used.parent == path.parent and used != path)
    if held_here + size <= cap and _store(path, tensors):
        _used_here[path] = size
        _evict(path.parent, cap)
    return tensors


def _entry_bytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _evict(folder: Path, cap: int) -> None:
    """Removes the least recently used entries of ``folder`` that this process did not use until it holds at most
    ``cap`` bytes (or only this process's)."""
    entries = []
    for entry in folder.glob('*.safetensors'):
        try:
            stat = entry.stat()
        except FileNotFoundError:
            continue
        entries.append((stat.st_mtime_ns, stat.st_size, entry))
    held = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries):
        if held <= cap:
            return
        if entry in _used_here:
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning('cannot remove derived-weight cache entry %s: %s', entry, err)
            continue
        held -= size


def _store(path: Path, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Writes the entry; False where it cannot."""
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
        return False
    return True
