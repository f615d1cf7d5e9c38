"""Streams tensors out of a Hugging Face folder's safetensors files, sharded or single.

Tensors come as lazy slices: a tensor-parallel rank reads only the rows or columns it holds
(:func:`read_shard`), straight from the memory-mapped file.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterator
from typing import Any, Union

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from lmdeploy.model_source import ModelNotFoundError
from lmdeploy.pytorch.distributed.parallel_state import Shard
from lmdeploy.pytorch.weights.file_checks import check_weight_index, unreadable


class FileTensor:
    """A tensor of a safetensors file; indexing it reads only the part indexed."""

    def __init__(self, path: str, handle: Any, name: str):
        self.path, self.handle, self.name = path, handle, name

    def read(self, index: tuple) -> torch.Tensor:
        try:
            part = self.handle.get_slice(self.name)
            return part[index] if part.get_shape() else self.handle.get_tensor(self.name)
        except (SafetensorError, OSError) as err:
            raise unreadable(self.path, err) from err


class TensorPart:
    """The indices ``start:stop`` along ``dim`` of a checkpoint tensor: one projection of a fused one
    (Phi-3's ``qkv_proj``); reading it reads only what is indexed."""

    def __init__(self, source: WeightSource, dim: int, start: int, stop: int):
        self.source, self.dim, self.start, self.stop = source, dim, start, stop

    def read(self, index: tuple) -> torch.Tensor:
        index = index + (slice(None),) * (self.dim + 1 - len(index))
        inner = index[self.dim]
        stop = self.stop if inner.stop is None else self.start + inner.stop
        index = index[:self.dim] + (slice(self.start + (inner.start or 0), stop),) + index[self.dim + 1:]
        return self.source[index] if isinstance(self.source, torch.Tensor) else self.source.read(index)


# A checkpoint tensor: loaded, one to read from its file, or a part of either.
WeightSource = Union[torch.Tensor, FileTensor, TensorPart]


def safetensors_files(model_dir: str) -> list[str]:
    """The folder's weight files; raises ``ModelNotFoundError`` for none, ``ConfigError`` where its index lists
    files it lacks."""
    files = sorted(glob.glob(os.path.join(model_dir, '*.safetensors')))
    if not files:
        raise ModelNotFoundError(f'no *.safetensors weight files in {model_dir}; give a folder with its weights')
    check_weight_index(model_dir)
    return files


def iterate_weights(model_dir: str, show_progress: bool = True) -> Iterator[tuple[str, WeightSource]]:
    """Yields ``(name, FileTensor)`` for every tensor, each readable until the next one is yielded; a
    truncated, corrupt or unreadable file raises ``ConfigError`` naming it."""
    files = safetensors_files(model_dir)
    for path in tqdm(files, desc='Loading weights', unit='file') if show_progress else files:
        try:
            with safe_open(path, framework='pt') as f:
                for name in f.keys():
                    yield name, FileTensor(path, f, name)
        except (SafetensorError, OSError) as err:
            raise unreadable(path, err) from err


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU ops on one thread for the duration: loading runs thousands of small copies and repacks, and on
    several threads each of them waits for every thread at its end, which other processes' load stretches to a
    timeslice (a 4-layer Qwen3-30B-A3B-shaped GGUF file: load 88 s on two threads, 33 s on one, load average 8)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def release_free_heap() -> None:
    """Gives the pages of glibc malloc's free chunks back to the system (``malloc_trim(0)``); nothing where the C
    library has no ``malloc_trim``. Called after each GGUF MoE layer's experts are retiled and once the model is
    loaded: retiling (thousands of tensors of 0.1-1.7 MB, in the heap beside their temporaries) leaves the freed
    temporaries' pages resident, 26 MiB a Qwen3-30B-A3B layer, about 1.3 GiB of its 48 (see
    docs/quantization.md, "MoE GGUF files")."""
    trim = getattr(ctypes.CDLL(None), 'malloc_trim', None)
    if trim is not None:
        trim(0)


def read_shard(source: WeightSource, shard: Shard | None) -> torch.Tensor:
    """The part ``shard`` of a checkpoint tensor (all of it for None), reading only that part from a file."""
    index = () if shard is None else (slice(None),) * shard.dim + (slice(shard.start, shard.stop),)
    if isinstance(source, torch.Tensor):
        return source[index]
    return source.read(index or (slice(None),))
