"""Streams tensors out of a Hugging Face folder's safetensors files, sharded or single."""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, '*.safetensors')))
    if not files:
        raise FileNotFoundError(f'no *.safetensors weight files in {model_dir}')
    return files


def iterate_weights(model_dir: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for every tensor; a corrupt file raises ``ValueError`` naming it."""
    files = safetensors_files(model_dir)
    for path in tqdm(files, desc='Loading weights', unit='file', disable=not show_progress):
        try:
            with safe_open(path, framework='pt') as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise ValueError(f'cannot read weight file {path}: {err}') from err
