"""Model files checked where they are read. A file that is there but cannot be served (truncated, corrupt,
incomplete, of a kind lmdeploy does not serve) raises :class:`~lmdeploy.messages.ConfigError` naming it, what is
wrong and what to do; a file that is not there raises :class:`~lmdeploy.model_source.ModelNotFoundError`. The
command line prints either as one line."""
from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
from gguf import GGUFReader

from lmdeploy.messages import ConfigError
from lmdeploy.model_source import ModelNotFoundError

REDOWNLOAD = 'it may be truncated (a download that did not finish) or corrupt: re-download it'
# architectures whose query projections are not ``heads * head_dim`` rows (multi-head latent attention)
_OTHER_HEAD_WIDTHS = frozenset({'deepseek2', 'glm-dsa', 'kimi-linear'})
_LAYER_INDEX = re.compile(r'blk\.(\d+)\.')


def unreadable(path: str | os.PathLike, err: Exception) -> ConfigError:
    """The error for a model file that is there but cannot be read: ``err``'s reason, and for anything but the
    file's permissions, that it may be truncated or corrupt."""
    if isinstance(err, PermissionError):
        return ConfigError(f'cannot read {path}: permission denied; make it readable by this user')
    reason = ' '.join(str(err).split())
    return ConfigError(f'{path} cannot be read ({type(err).__name__}: {reason}); {REDOWNLOAD}')


class PlainArrayReader(GGUFReader):
    """gguf's reader over a plain ``ndarray`` view of the file's mapping: the same fields and tensors, read 4x
    faster (each of the reader's slices of an ``np.memmap`` runs memmap's Python hooks: about 8 s of CPU for the
    three 262k-entry vocabulary arrays of Gemma 3's file)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapping: np.ndarray) -> None:
        self._data = mapping.view(np.ndarray)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """A reader of the GGUF file ``path``; a truncated, corrupt or unreadable file raises ``ConfigError``."""
    if not os.path.isfile(path):
        raise ModelNotFoundError(f'GGUF file {path} does not exist' +
                                 (' (it is a folder)' if os.path.isdir(path) else ''))
    try:
        return PlainArrayReader(path)
    except PermissionError as err:
        raise unreadable(path, err) from err
    except Exception as err:  # the reader fails with numpy/struct/index errors on bad or missing bytes
        reason = ' '.join(str(err).split())
        raise ConfigError(f'{path} is not a valid GGUF file ({type(err).__name__}: {reason}); {REDOWNLOAD}') from err


def check_gguf(reader: GGUFReader, arch: str, config: dict[str, Any], source: str) -> None:
    """Raises ``ConfigError`` where a GGUF file of architecture ``arch`` has metadata that disagrees with its
    tensors (``config``: the config built from that metadata) or lacks its tokenizer, before anything is
    converted."""
    if 'tokenizer.ggml.tokens' not in reader.fields:
        raise ConfigError(f'{source} has no tokenizer (no tokenizer.ggml.tokens metadata): lmdeploy takes the '
                          'tokenizer from the GGUF file; use a file converted with its tokenizer, as llama.cpp '
                          'writes them')
    layers = {int(match[1]) for t in reader.tensors if (match := _LAYER_INDEX.match(t.name))}
    missing = [i for i in range(config['num_hidden_layers']) if i not in layers]
    if missing:
        raise ConfigError(f'{source}: its {arch}.block_count is {config["num_hidden_layers"]} but it holds no '
                          f'tensors of blk.{missing[0]} ({len(layers)} layers present); the file is incomplete or '
                          f'its metadata is wrong: re-download it')
    heads, kv_heads, head_dim = config['num_attention_heads'], config['num_key_value_heads'], config['head_dim']
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or arch in _OTHER_HEAD_WIDTHS:
        return
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ConfigError(f'{source}: {arch}.attention.head_count ({heads}) must be a positive multiple of '
                          f'{arch}.attention.head_count_kv ({kv_heads}); its metadata is wrong: re-download it')
    tensors = {t.name: t for t in reader.tensors}
    for name, count, key in (('attn_q', heads, 'head_count'), ('attn_k', kv_heads, 'head_count_kv')):
        tensor = tensors.get(f'blk.0.{name}.weight')
        if tensor is not None and int(tensor.shape[-1]) != count * head_dim:  # ggml order: (inputs, rows)
            raise ConfigError(f'{source}: blk.0.{name}.weight has {int(tensor.shape[-1])} rows, not {arch}.'
                              f'attention.{key} ({count}) x head dim ({head_dim}); its metadata is wrong: '
                              're-download it')


def read_config_json(model_dir: str) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict; a file that is not a JSON object raises ``ConfigError``."""
    path = os.path.join(model_dir, 'config.json')
    if not os.path.isfile(path):
        raise ModelNotFoundError(f'{model_dir} has no config.json')
    try:
        with open(path, encoding='utf-8') as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError) as err:
        raise unreadable(path, err) from err
    except json.JSONDecodeError as err:
        raise ConfigError(f'{path} is not valid JSON ({err}); {REDOWNLOAD}') from err
    if not isinstance(config, dict):
        raise ConfigError(f'{path} is not valid JSON config: it holds a {type(config).__name__}, not an object')
    return config


def check_weight_index(model_dir: str) -> None:
    """Raises ``ConfigError`` where ``model.safetensors.index.json`` lists weight files the folder lacks."""
    index = os.path.join(model_dir, 'model.safetensors.index.json')
    if not os.path.isfile(index):
        return
    try:
        with open(index, encoding='utf-8') as f:
            shards = sorted(set(json.load(f)['weight_map'].values()))
    except (OSError, UnicodeDecodeError) as err:
        raise unreadable(index, err) from err
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f'{index} is not a valid weight index (a JSON object with a weight_map); '
                          f're-download it') from err
    missing = [shard for shard in shards if not os.path.isfile(os.path.join(model_dir, shard))]
    if missing:
        raise ConfigError(f'{model_dir}: weight file {missing[0]} is missing ({len(missing)} of the {len(shards)} '
                          'that model.safetensors.index.json lists): the download is incomplete; re-download it')
