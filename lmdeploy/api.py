"""Entry points: ``pipeline()``."""
from __future__ import annotations

import logging

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pipeline import Pipeline


def pipeline(model_path: str | None = None, backend_config: PytorchEngineConfig | None = None,
             log_level: str = 'WARNING', **kwargs) -> Pipeline:
    """Creates a :class:`Pipeline` for a local HF folder or ``.gguf`` file; no path means the default model."""
    logging.getLogger('lmdeploy').setLevel(log_level)
    return Pipeline(model_path, backend_config=backend_config, **kwargs)
