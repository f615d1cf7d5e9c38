"""lmdeploy: serve large language models with an in-tree PyTorch engine."""
from __future__ import annotations

import importlib
from typing import Any

__version__ = '0.1.0'
# Imported on first use, so that ``lmdeploy --help`` and ``import lmdeploy.cli`` do not load torch.
_EXPORTS = {'client': 'lmdeploy.api', 'pipeline': 'lmdeploy.api', 'serve': 'lmdeploy.api',
            'ChatTemplateConfig': 'lmdeploy.messages', 'GenerationConfig': 'lmdeploy.messages',
            'PytorchEngineConfig': 'lmdeploy.messages', 'Response': 'lmdeploy.messages',
            'Pipeline': 'lmdeploy.pipeline'}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
