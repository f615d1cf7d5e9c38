"""lmdeploy: serve large language models with an in-tree PyTorch engine."""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = '0.1.0'
# The public names, imported on first use: ``import lmdeploy`` (and so ``lmdeploy --help``) loads no torch.
_EXPORTS = {'client': 'lmdeploy.api', 'pipeline': 'lmdeploy.api', 'serve': 'lmdeploy.api',
            'ChatTemplateConfig': 'lmdeploy.messages', 'GenerationConfig': 'lmdeploy.messages',
            'PytorchEngineConfig': 'lmdeploy.messages', 'Response': 'lmdeploy.messages',
            'Pipeline': 'lmdeploy.pipeline'}
__all__ = sorted(_EXPORTS)


class _LazyExports(types.ModuleType):
    """``lmdeploy.NAME`` is the export NAME, also once the submodule of the same name (``lmdeploy.pipeline``)
    is imported and set as the package's attribute."""

    def __getattribute__(self, name: str) -> Any:
        if name in _EXPORTS:
            return getattr(importlib.import_module(_EXPORTS[name]), name)
        return super().__getattribute__(name)


sys.modules[__name__].__class__ = _LazyExports
