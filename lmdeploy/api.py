"""Entry points: ``pipeline()``, the deprecated ``serve()``, and ``client()``."""
from __future__ import annotations

import logging
import warnings

from lmdeploy.messages import ChatTemplateConfig, PytorchEngineConfig
from lmdeploy.pipeline import Pipeline
from lmdeploy.serve.openai.api_client import APIClient


def pipeline(model_path: str | None = None, backend_config: PytorchEngineConfig | None = None,
             chat_template_config: ChatTemplateConfig | None = None, log_level: str = 'WARNING',
             **kwargs) -> Pipeline:
    """Creates a :class:`Pipeline` for a local HF folder or ``.gguf`` file; no path means the default model.

    ``kwargs`` go to :class:`Pipeline` (e.g. ``show_progress=False``, or ``reasoning_parser``: 'auto', the
    model's own, by default; a parser's name such as 'qwen3'; None for none).
    """
    logging.getLogger('lmdeploy').setLevel(log_level)
    return Pipeline(model_path, backend_config=backend_config, chat_template_config=chat_template_config, **kwargs)


def serve(*args, **kwargs) -> None:
    """Deprecated: start the server with ``lmdeploy serve api_server MODEL`` and talk to it with :func:`client`."""
    warnings.warn('lmdeploy.serve() is deprecated; run `lmdeploy serve api_server MODEL` instead and connect '
                  'with lmdeploy.client(url)', DeprecationWarning, stacklevel=2)
    raise NotImplementedError('lmdeploy.serve() no longer starts a server; run `lmdeploy serve api_server MODEL`')


def client(api_server_url: str = 'http://0.0.0.0:23333', api_key: str | None = None, **kwargs) -> APIClient:
    """An :class:`APIClient` for a running OpenAI-compatible server."""
    return APIClient(api_server_url, api_key=api_key, **kwargs)
